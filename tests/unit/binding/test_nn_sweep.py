"""Every stock torch.nn module runs forward and backward under the default O1
and O2 lists, fed fp32 input with fp32 parameters, both directly and through
a listed op (``matmul``, in both BF16 lists: its output is bf16, as after a
Linear).

Each class of torch.nn gets simple constructor arguments and inputs here;
a class with neither a spec nor a stated reason fails
test_every_module_class_has_a_spec_or_a_reason, so a new torch release cannot slip one
past the sweep.
"""

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp

N, C = 2, 4


def x(*shape):
    return ("float", shape)


def pos(*shape):  # a float input with values in (0, 1)
    return ("prob", shape)


def target(*shape):  # fp32, not fed through a listed op (labels stay as the data gives them)
    return ("target", shape)


def ids(high, *shape):
    return ("long", (high, shape))


def const(value):
    return ("const", value)


S3 = (3, N, 8)  # (L, N, E) for attention and transformers
SPECS = {
    # activations and element-wise modules
    **{
        name: ((), [x(N, C)])
        for name in (
            "CELU",
            "ELU",
            "GELU",
            "GLU",
            "Hardshrink",
            "Hardsigmoid",
            "Hardswish",
            "Hardtanh",
            "Identity",
            "LeakyReLU",
            "LogSigmoid",
            "Mish",
            "PReLU",
            "ReLU",
            "ReLU6",
            "RReLU",
            "SELU",
            "SiLU",
            "Sigmoid",
            "Softplus",
            "Softshrink",
            "Softsign",
            "Tanh",
            "Tanhshrink",
            "Dropout",
            "AlphaDropout",
        )
    },
    "Softmax": ((-1,), [x(N, C)]),
    "Softmin": ((-1,), [x(N, C)]),
    "LogSoftmax": ((-1,), [x(N, C)]),
    "Softmax2d": ((), [x(N, C, 3, 3)]),
    "Threshold": ((0.1, 0.0), [x(N, C)]),
    "FeatureAlphaDropout": ((), [x(N, C, 4)]),
    "Dropout1d": ((), [x(N, C, 4)]),
    "Dropout2d": ((), [x(N, C, 3, 3)]),
    "Dropout3d": ((), [x(N, C, 2, 2, 2)]),
    "Flatten": ((), [x(N, C, 3)]),
    "Unflatten": ((1, (2, 2)), [x(N, C)]),
    # linear and embedding
    "Linear": ((C, 3), [x(N, C)]),
    "LazyLinear": ((3,), [x(N, C)]),
    "Bilinear": ((C, C, 3), [x(N, C), x(N, C)]),
    "Embedding": ((10, C), [ids(10, N, 3)]),
    "EmbeddingBag": ((10, C), [ids(10, N, 3)]),
    # convolutions
    "Conv1d": ((C, C, 3), [x(N, C, 6)]),
    "Conv2d": ((C, C, 3), [x(N, C, 5, 5)]),
    "Conv3d": ((C, C, 3), [x(N, C, 4, 4, 4)]),
    "ConvTranspose1d": ((C, C, 3), [x(N, C, 6)]),
    "ConvTranspose2d": ((C, C, 3), [x(N, C, 4, 4)]),
    "ConvTranspose3d": ((C, C, 3), [x(N, C, 3, 3, 3)]),
    "LazyConv1d": ((C, 3), [x(N, C, 6)]),
    "LazyConv2d": ((C, 3), [x(N, C, 5, 5)]),
    "LazyConv3d": ((C, 3), [x(N, C, 4, 4, 4)]),
    "LazyConvTranspose1d": ((C, 3), [x(N, C, 6)]),
    "LazyConvTranspose2d": ((C, 3), [x(N, C, 4, 4)]),
    "LazyConvTranspose3d": ((C, 3), [x(N, C, 3, 3, 3)]),
    "Fold": (((4, 4), 2), [x(N, C * 4, 9)]),
    "Unfold": ((2,), [x(N, C, 4, 4)]),
    # normalization
    "BatchNorm1d": ((C,), [x(N, C)]),
    "BatchNorm2d": ((C,), [x(N, C, 3, 3)]),
    "BatchNorm3d": ((C,), [x(N, C, 2, 2, 2)]),
    "LazyBatchNorm1d": ((), [x(N, C)]),
    "LazyBatchNorm2d": ((), [x(N, C, 3, 3)]),
    "LazyBatchNorm3d": ((), [x(N, C, 2, 2, 2)]),
    "InstanceNorm1d": ((C,), [x(N, C, 6)]),
    "InstanceNorm2d": ((C,), [x(N, C, 3, 3)]),
    "InstanceNorm3d": ((C,), [x(N, C, 2, 2, 2)]),
    "LazyInstanceNorm1d": ((), [x(N, C, 6)]),
    "LazyInstanceNorm2d": ((), [x(N, C, 3, 3)]),
    "LazyInstanceNorm3d": ((), [x(N, C, 2, 2, 2)]),
    "GroupNorm": ((2, C), [x(N, C, 3)]),
    "LayerNorm": ((C,), [x(N, C)]),
    "RMSNorm": ((C,), [x(N, C)]),
    "LocalResponseNorm": ((2,), [x(N, C, 3, 3)]),
    "CrossMapLRN2d": ((3,), [x(N, C, 3, 3)]),
    # pooling, padding, reshaping
    **{
        f"{kind}{d}d": ((2, 2) if kind == "LPPool" else (2,), [x(N, C, *size)])
        for kind in ("AdaptiveAvgPool", "AdaptiveMaxPool", "AvgPool", "MaxPool", "LPPool")
        for d, size in ((1, (6,)), (2, (4, 4)), (3, (4, 4, 4)))
    },
    "FractionalMaxPool2d": ((2,), [x(N, C, 5, 5)], {"output_size": 2}),
    "FractionalMaxPool3d": ((2,), [x(N, C, 5, 5, 5)], {"output_size": 2}),
    "MaxUnpool1d": ((2,), [x(N, C, 3), ("indices", (N, C, 3))]),
    "MaxUnpool2d": ((2,), [x(N, C, 2, 2), ("indices", (N, C, 2, 2))]),
    "MaxUnpool3d": ((2,), [x(N, C, 2, 2, 2), ("indices", (N, C, 2, 2, 2))]),
    **{
        f"{kind}Pad{d}d": ((1,) if kind != "Constant" else (1, 0.5), [x(N, C, *(4,) * d)])
        for kind in ("Circular", "Constant", "Reflection", "Replication", "Zero")
        for d in (1, 2, 3)
    },
    "PixelShuffle": ((2,), [x(N, C, 2, 2)]),
    "PixelUnshuffle": ((2,), [x(N, 1, 4, 4)]),
    "ChannelShuffle": ((2,), [x(N, C, 2, 2)]),
    "Upsample": ((), [x(N, C, 3, 3)], {"scale_factor": 2}),
    "UpsamplingNearest2d": ((), [x(N, C, 3, 3)], {"scale_factor": 2}),
    "UpsamplingBilinear2d": ((), [x(N, C, 3, 3)], {"scale_factor": 2}),
    "CosineSimilarity": ((), [x(N, C), x(N, C)]),
    "PairwiseDistance": ((), [x(N, C), x(N, C)]),
    # losses: predictions fed, targets as given
    **{
        name: ((), [x(N, C), target(N, C)])
        for name in (
            "L1Loss",
            "MSELoss",
            "HuberLoss",
            "SmoothL1Loss",
            "SoftMarginLoss",
            "MultiLabelSoftMarginLoss",
            "BCEWithLogitsLoss",
            "PoissonNLLLoss",
        )
    },
    "BCELoss": ((), [pos(N, C), ("prob_target", (N, C))]),
    "KLDivLoss": ((), [x(N, C), ("prob_target", (N, C))], {"reduction": "batchmean"}),
    "GaussianNLLLoss": ((), [x(N, C), target(N, C), pos(N, C)]),
    "CrossEntropyLoss": ((), [x(N, C), ids(C, N)]),
    "NLLLoss": ((), [x(N, C), ids(C, N)]),
    "NLLLoss2d": ((), [x(N, C, 2, 2), ids(C, N, 2, 2)]),
    "MultiMarginLoss": ((), [x(N, C), ids(C, N)]),
    "MultiLabelMarginLoss": ((), [x(N, C), ("labels", (N, C))]),
    "CosineEmbeddingLoss": ((), [x(N, C), x(N, C), ("signs", (N,))]),
    "MarginRankingLoss": ((), [x(N), x(N), ("signs", (N,))]),
    "HingeEmbeddingLoss": ((), [x(N, C), ("signs", (N, C))]),
    "TripletMarginLoss": ((), [x(N, C), x(N, C), x(N, C)]),
    "TripletMarginWithDistanceLoss": ((), [x(N, C), x(N, C), x(N, C)]),
    "AdaptiveLogSoftmaxWithLoss": ((C, 10, [4]), [x(N, C), ids(10, N)]),
    "LinearCrossEntropyLoss": ((C, 5), [x(N, C), ids(5, N)]),
    "CTCLoss": (
        (),
        [("log_probs", (6, N, 5)), ("ctc_targets", (N, 3)), const(torch.full((N,), 6)), const(torch.full((N,), 3))],
    ),
    # recurrent
    "RNN": ((C, C), [x(3, N, C)]),
    "LSTM": ((C, C), [x(3, N, C)]),
    "GRU": ((C, C), [x(3, N, C)]),
    "RNNCell": ((C, C), [x(N, C)]),
    "LSTMCell": ((C, C), [x(N, C)]),
    "GRUCell": ((C, C), [x(N, C)]),
    # attention and transformers (the combinations: masks, need_weights)
    "MultiheadAttention": ((8, 2), [x(*S3), x(*S3), x(*S3)]),
    "MultiheadAttention+key_padding_mask": (
        (8, 2),
        [x(*S3), x(*S3), x(*S3)],
        {},
        {"key_padding_mask": ("pad_mask", (N, 3))},
    ),
    "MultiheadAttention+attn_mask": ((8, 2), [x(*S3), x(*S3), x(*S3)], {}, {"attn_mask": ("float_mask", (3, 3))}),
    "MultiheadAttention+both masks, no weights": (
        (8, 2),
        [x(*S3), x(*S3), x(*S3)],
        {},
        {"key_padding_mask": ("pad_mask", (N, 3)), "attn_mask": ("bool_mask", (3, 3)), "need_weights": False},
    ),
    "TransformerEncoderLayer": ((8, 2, 16), [x(*S3)], {}, {"src_key_padding_mask": ("pad_mask", (N, 3))}),
    "TransformerDecoderLayer": ((8, 2, 16), [x(*S3), x(*S3)], {}, {"tgt_mask": ("causal", (3, 3))}),
    "TransformerEncoder": (("encoder_layer",), [x(*S3)], {}, {"mask": ("causal", (3, 3))}),
    "TransformerDecoder": (("decoder_layer",), [x(*S3), x(*S3)]),
    "Transformer": (
        (),
        [x(*S3), x(*S3)],
        {"d_model": 8, "nhead": 2, "num_encoder_layers": 1, "num_decoder_layers": 1, "dim_feedforward": 16},
        {"tgt_mask": ("causal", (3, 3)), "src_key_padding_mask": ("pad_mask", (N, 3))},
    ),
}
NOT_RUN = {
    "Module": "base class",
    "Container": "deprecated base class",
    "Sequential": "container",
    "ModuleList": "container",
    "ModuleDict": "container",
    "ParameterList": "container",
    "ParameterDict": "container",
    "RNNBase": "base class (RNN, LSTM, GRU run)",
    "RNNCellBase": "base class (the cells run)",
    "DataParallel": "wraps a module; needs CUDA to do anything",
    "SyncBatchNorm": "needs a process group and an accelerator",
}


def build(name):
    ctor, inputs, kwargs, call_kwargs = (SPECS[name] + ({}, {}))[:4]
    cls = getattr(nn, name.split("+")[0])
    if ctor == ("encoder_layer",):
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 1), inputs, call_kwargs
    if ctor == ("decoder_layer",):
        return nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 1), inputs, call_kwargs
    return cls(*ctor, **kwargs), inputs, call_kwargs


def make(spec, fed):
    """One input: float inputs are leaves that require grad; ``fed`` passes
    them through a listed op (matmul with an identity) first."""
    kind, arg = spec
    g = torch.Generator().manual_seed(0)
    if kind in ("float", "prob", "log_probs"):
        leaf = torch.randn(arg, generator=g)
        if kind == "prob":
            leaf = torch.rand(arg, generator=g) * 0.8 + 0.1
        if kind == "log_probs":
            leaf = torch.randn(arg, generator=g).log_softmax(-1)
        leaf.requires_grad_(True)
        value = torch.matmul(leaf, torch.eye(arg[-1])) if fed else leaf
        return leaf, value
    if kind == "target":
        return None, torch.randn(arg, generator=g)
    if kind == "prob_target":
        return None, torch.rand(arg, generator=g).softmax(-1)
    if kind == "long":
        high, shape = arg
        return None, torch.randint(0, high, shape, generator=g)
    if kind == "indices":  # what max_pool with return_indices gives for a window of 2
        return None, F.max_pool1d(torch.randn(arg[0], arg[1], 2 * arg[-1] ** (len(arg) - 2)), 2, return_indices=True)[
            1
        ].reshape(arg) if len(arg) == 3 else _indices(arg)
    if kind == "labels":
        return None, torch.tensor([[1, 0, -1, 2]] * arg[0])
    if kind == "signs":
        return None, torch.randint(0, 2, arg, generator=g).float() * 2 - 1
    if kind == "ctc_targets":
        return None, torch.randint(1, 5, arg, generator=g)
    if kind == "pad_mask":
        mask = torch.zeros(arg, dtype=torch.bool)
        mask[:, -1] = True
        return None, mask
    if kind == "float_mask":
        return None, torch.triu(torch.full(arg, float("-inf")), 1)
    if kind in ("bool_mask", "causal"):
        mask = torch.triu(torch.ones(arg, dtype=torch.bool), 1)
        return None, mask if kind == "bool_mask" else nn.Transformer.generate_square_subsequent_mask(arg[0])
    if kind == "const":
        return None, arg
    raise AssertionError(kind)


def _indices(shape):
    pool = F.max_pool2d if len(shape) == 4 else F.max_pool3d
    big = torch.randn(*shape[:2], *(2 * s for s in shape[2:]))
    return pool(big, 2, return_indices=True)[1]


def floats(value):
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floats(v)]
    if hasattr(value, "output"):  # AdaptiveLogSoftmaxWithLoss's named tuple
        return floats(tuple(value))
    return []


def run(name, opt_level, fed):
    torch.manual_seed(0)
    module, inputs, call_kwargs = build(name)
    pairs = [make(spec, fed) for spec in inputs]
    kwargs = {k: (make(v, False)[1] if isinstance(v, tuple) else v) for k, v in call_kwargs.items()}
    out = module(*[v for _, v in pairs], **kwargs)
    outs = floats(out)
    assert outs, f"{name}: no differentiable output"
    sum(o.float().sum() for o in outs).backward()
    leaves = [leaf for leaf, _ in pairs if leaf is not None]
    assert any(leaf.grad is not None for leaf in leaves) or not leaves
    params = [p for p in module.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in params)  # parameters stay as built


def _params():
    for name in SPECS:
        yield pytest.param(name, id=name)


def _torch_lacks(name):
    """Why this torch cannot run ``name`` in the sweep without hmp (a class
    it does not have, a kernel or derivative missing), or None."""
    cls = name.split("+")[0]
    if not hasattr(nn, cls):
        return f"torch {torch.__version__} has no torch.nn.{cls}"
    probes = {
        # bf16 reaches them from a listed op before them
        "MaxUnpool": lambda: F.max_unpool2d(
            torch.ones(1, 1, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 1, 2, 2, dtype=torch.long), 2
        ),
        "ChannelShuffle": lambda: nn.ChannelShuffle(2)(torch.ones(1, 2, 1, 1, requires_grad=True)).sum().backward(),
    }
    probe = next((p for prefix, p in probes.items() if cls.startswith(prefix)), None)
    try:
        if probe is not None:
            probe()
    except RuntimeError as e:
        return f"torch {torch.__version__} itself cannot: {e}"
    return None


@pytest.mark.parametrize("name", list(_params()))
def test_module_forward_backward_under_default_lists(name, one_intra_op_thread):
    lacking = _torch_lacks(name)
    if lacking:
        pytest.skip(lacking)
    for opt_level in ("O1", "O2"):
        hmp.convert(opt_level=opt_level)
        try:
            for fed in (False, True):
                run(name, opt_level, fed)
        finally:
            hmp.revert()


def test_every_module_class_has_a_spec_or_a_reason():
    classes = {n for n in dir(nn) if inspect.isclass(getattr(nn, n)) and issubclass(getattr(nn, n), nn.Module)}
    covered = {name.split("+")[0] for name in SPECS}
    missing = classes - covered - set(NOT_RUN)
    assert not missing, f"torch.nn classes with no spec and no reason: {sorted(missing)}"


# -- parametrizations -------------------------------------------------------------------------------

P = torch.nn.utils.parametrizations
PARAMETRIZATIONS = {
    "orthogonal": P.orthogonal,
    "spectral_norm": P.spectral_norm,
    "weight_norm": P.weight_norm,
    "torch.nn.utils.spectral_norm": torch.nn.utils.spectral_norm,  # the older hook-based forms
    "torch.nn.utils.weight_norm": torch.nn.utils.weight_norm,
}


def _parametrized(apply):
    torch.manual_seed(0)
    with hmp.disable_casts():  # building them runs ops too; what is tested is the training forward
        return nn.Sequential(apply(nn.Linear(C, C)), nn.ReLU(), apply(nn.Linear(C, 3)))


@pytest.mark.parametrize("name", sorted(PARAMETRIZATIONS))
def test_parametrization_forward_backward_under_default_lists(name, one_intra_op_thread):
    for opt_level in ("O1", "O2"):
        hmp.convert(opt_level=opt_level)
        try:
            model = _parametrized(PARAMETRIZATIONS[name])
            for fed in (False, True):
                for train in (True, False):  # spectral norm's power iteration runs in training only
                    leaf, value = make(x(N, C), fed)
                    model.train(train)
                    out = model(value)
                    assert out.dtype == torch.bfloat16  # the Linear layers ran under the BF16 rule
                    out.float().sum().backward()
                    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
            assert {p.dtype for p in model.parameters()} == {torch.float32}
            assert {b.dtype for b in model.buffers()} <= {torch.float32}  # power-iteration vectors keep theirs
        finally:
            hmp.revert()


def test_every_parametrization_is_swept():
    public = {
        n
        for n in getattr(P, "__all__", dir(P))
        if callable(getattr(P, n)) and not n.startswith("_") and not inspect.isclass(getattr(P, n))
    }
    assert public <= set(PARAMETRIZATIONS), sorted(public - set(PARAMETRIZATIONS))
