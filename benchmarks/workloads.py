"""Model workloads: how to build one (same seed, same weights for every
configuration) and what one timed step is; and the models the other scripts
build by name (a Llama, GPT-2, tune_models.py's CNN, the recurrent kinds), in
one place so scripts that share a model build the same one."""

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp

SEED = 1234


@dataclass
class State:
    model: nn.Module
    x: torch.Tensor
    y: object  # targets, or None for inference
    opt: object  # optimizer, or None for inference


def _seeded(seed):
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


class Workload:
    name = ""
    description = ""
    train = True
    iters = 1  # steps per timed sample
    quick_iters = 1
    reps = 7  # default samples per configuration
    warmup = 2

    def make_model(self, quick):
        raise NotImplementedError

    def make_data(self, quick, gen):
        raise NotImplementedError

    def build(self, cfg, device, quick):
        gen = _seeded(SEED)
        model = self.make_model(quick)
        x, y = self.make_data(quick, gen)
        model = model.to(device=device, dtype=cfg.model_dtype)
        x = x.to(device=device, dtype=cfg.model_dtype if x.is_floating_point() else x.dtype)
        y = None if y is None else y.to(device)
        if self.train:
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        else:
            model.eval()
            opt = None
        return State(model, x, y, opt)

    def expected_dtype(self, cfg, device):
        """The output dtype ``cfg`` gives, called inside ``cfg.active()``: the
        last op is a linear layer, which every mixed scheme runs in bf16."""
        return "float32" if cfg.kind == "fp32" else "bfloat16"

    def loss(self, out, y):
        return F.cross_entropy(out, y)

    def step(self, st, cfg, device):
        """One step; returns the model output (for dtype reporting)."""
        if self.train:
            st.opt.zero_grad(set_to_none=True)
            with cfg.forward_ctx(device):
                out = st.model(st.x)
                loss = self.loss(out, st.y)
            loss.backward()
            with cfg.optimizer_ctx():
                st.opt.step()
            return out
        with torch.no_grad(), cfg.forward_ctx(device):
            return st.model(st.x)


def _fast_path(cfg, device):
    """Whether nn.TransformerEncoder takes its fused inference path under
    ``cfg`` (eval, no_grad and the encoder's shape allow it): torch's own
    switch and its own autocast check."""
    if not torch.backends.mha.get_fastpath_enabled():
        return False
    if cfg.kind != "autocast":
        return True
    with cfg.forward_ctx(device):
        return not torch.is_autocast_enabled()


def _encoder(d, heads, ffn, layers, dropout):
    layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _tf_sizes(quick):
    # d_model, heads, ffn, layers, seq, vocab
    return (64, 4, 128, 2, 16, 100) if quick else (512, 8, 2048, 4, 128, 1000)


class _Head(nn.Module):
    def __init__(self, enc, d, vocab):
        super().__init__()
        self.enc = enc
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(x)).flatten(0, 1)


class TransformerTrain(Workload):
    name = "transformer"
    description = (
        "TransformerEncoder training: d_model 512, 8 heads, FFN 2048, 4 layers, batch 16x128, dropout 0.1, SGD"
    )
    reps = 5
    warmup = 1

    def make_model(self, quick):
        d, h, f, n, _, v = _tf_sizes(quick)
        return _Head(_encoder(d, h, f, n, 0.1), d, v)

    def make_data(self, quick, gen):
        d, _, _, _, s, v = _tf_sizes(quick)
        b = 4 if quick else 16
        return torch.randn(b, s, d, generator=gen), torch.randint(0, v, (b * s,), generator=gen)


class TransformerInfer(Workload):
    train = False
    reps = 9
    warmup = 3

    def __init__(self, batch):
        self.batch = batch
        self.name = f"infer_b{batch}"
        self.description = (
            f"TransformerEncoder inference, eval()+no_grad(), batch {batch}x128 "
            "(same encoder; nn.TransformerEncoder may take its fused fast path)"
        )
        self.iters = 5 if batch == 1 else 1
        self.reps = 15 if batch == 1 else 7
        self.warmup = 3 if batch == 1 else 2

    def make_model(self, quick):
        d, h, f, n, _, _ = _tf_sizes(quick)
        return _encoder(d, h, f, n, 0.1)

    def expected_dtype(self, cfg, device):
        """On torch's fused fast path a layer is one kernel that follows
        linear's rule: bf16 under every mixed scheme. Off it, the last op is
        norm2's layer_norm of the residual sum (float32 + bf16 = float32):
        bf16 only where the scheme lowers layer_norm (hmp: strict=True only,
        where its list names it). autocast never does
        (CUDA lists it fp32, CPU not at all), and torch leaves the fast path
        when its autocast check sees a region (CUDA's only, on torch 2.x), so
        autocast gives float32 on CUDA and bf16 on CPU."""
        if cfg.kind in ("fp32", "bf16"):
            return "float32" if cfg.kind == "fp32" else "bfloat16"
        if _fast_path(cfg, device):
            return "bfloat16"
        if cfg.is_hmp and hmp.effective_lists(detail=True)["bf16"].get("layer_norm") == "cast":
            return "bfloat16"
        return "float32"

    def make_data(self, quick, gen):
        d, _, _, _, s, _ = _tf_sizes(quick)
        return torch.randn(self.batch, s, d, generator=gen), None


class MLPTrain(Workload):
    name = "mlp"
    description = "MLP training step: 3 Linear layers 64 wide, ReLU, batch 32, cross-entropy, SGD (overhead-bound)"
    iters = 50
    quick_iters = 5
    reps = 21
    warmup = 20

    def make_model(self, quick):
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def make_data(self, quick, gen):
        return torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)


class CNNTrain(Workload):
    name = "cnn"
    description = (
        "small CNN training step: 3x conv3x3+BatchNorm+ReLU (32/64/128 ch), maxpool, avgpool, linear; "
        "batch 32x3x32x32, SGD"
    )
    iters = 2
    reps = 7
    warmup = 2

    def make_model(self, quick):
        def block(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU()]

        return nn.Sequential(
            *block(3, 32),
            *block(32, 64),
            nn.MaxPool2d(2),
            *block(64, 128),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, 10),
        )

    def make_data(self, quick, gen):
        b, s = (4, 16) if quick else (32, 32)
        return torch.randn(b, 3, s, s, generator=gen), torch.randint(0, 10, (b,), generator=gen)


class Accumulate(Workload):
    """Gradient accumulation (issue 56): where hmp.accumulation() casts each weight once per step."""

    name = "accumulate"
    description = (
        "gradient accumulation, weight-heavy: TransformerEncoder d_model 512, FFN 2048, 4 layers, "
        "4 micro-batches of batch 1x16 per SGD step"
    )
    micro = 4
    reps = 7
    warmup = 1

    def make_model(self, quick):
        d, h, f, n, _, v = _tf_sizes(quick)
        return _Head(_encoder(d, h, f, n, 0.0), d, v)

    def make_data(self, quick, gen):
        d, _, _, _, s, v = _tf_sizes(quick)
        s = min(s, 16)
        return torch.randn(self.micro, s, d, generator=gen), torch.randint(0, v, (self.micro, s), generator=gen)

    def step(self, st, cfg, device):
        st.opt.zero_grad(set_to_none=True)
        for x, y in zip(st.x.split(1), st.y.split(1)):  # micro-batches of one sample
            with cfg.forward_ctx(device):
                out = st.model(x)
                loss = self.loss(out, y.flatten()) / self.micro
            loss.backward()
        with cfg.optimizer_ctx():
            st.opt.step()
        return out


def all_workloads():
    return [TransformerTrain(), MLPTrain(), TransformerInfer(1), TransformerInfer(16), CNNTrain(), Accumulate()]


# ---------------------------------------------------------------- models the scripts build by name
# Random init from a fixed seed, nothing downloaded: the same weights, so the same numbers, every run.

# Llama shapes (transformers.LlamaConfig fields): wrapped_calls.py's small Llama, decode.py's CPU proxy
# (the same at 512 positions) and TinyLlama's shape (1.1B parameters) for a GPU
LLAMA = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "tinyllama": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
}
LLAMA["proxy"] = dict(LLAMA["tiny"], max_position_embeddings=512)

# GPT-2 shapes (transformers.GPT2Config fields) for gpu.py: 124M, a dry run's, and a CPU's compiled step
GPT2 = {
    "full": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
    "dry": dict(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=1000),
    # issue 40's compiled-step check on a CPU: small enough to compile in minutes, big enough that
    # a step is more than overhead
    "cpu": dict(n_layer=2, n_embd=256, n_head=4, n_positions=128, vocab_size=2000),
}

# rnn_precision.py's recurrent kinds, 2 layers of width h
RNN_KINDS = {
    "lstm": lambda h: nn.LSTM(h, h, 2),
    "gru": lambda h: nn.GRU(h, h, 2),
    "rnn_tanh": lambda h: nn.RNN(h, h, 2),
    "rnn_relu": lambda h: nn.RNN(h, h, 2, nonlinearity="relu"),
}


def llama(size, device="cpu", attn="sdpa", seed=0):
    """``(model, config)``: a transformers LlamaForCausalLM of ``size`` (a LLAMA key, or a dict of
    LlamaConfig fields), initialised from ``seed`` on ``device``, in train mode. ``attn``: the
    attention implementation (None: transformers' default)."""
    import transformers

    cfg = transformers.LlamaConfig(**(LLAMA[size] if isinstance(size, str) else size))
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg), cfg


def cache_kw(model):
    """The name ``model.forward`` takes the KV cache by: transformers 5 ``cache``, 4.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out):
    """A forward's KV cache, under either name."""
    return out.cache if hasattr(out, "cache") else out.past_key_values  # an empty cache is falsy: no `or`


def gpt2(size, device="cpu", attn="sdpa", seed=0):
    """``(model, config)``: a transformers GPT2LMHeadModel of ``size`` (a GPT2 key), initialised from
    ``seed`` on ``device``; ``attn``: the attention implementation."""
    import transformers

    cfg = transformers.GPT2Config(**GPT2[size])
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(cfg), cfg


def grating_cnn(size=16, classes=4, seed=0):
    """tune_models.py's CNN for one-channel ``size`` x ``size`` images: two conv+BatchNorm+ReLU+maxpool
    blocks (32, 64 channels), a 128-wide hidden layer with dropout. Not CNNTrain's (three RGB blocks,
    average pool, no dropout): the RESULTS of each were measured on its own."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (size // 4) ** 2, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, classes),
    )
