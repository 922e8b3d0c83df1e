"""Valid calls of the ops in hmp's shipped lists, one builder per list name.

torch keeps its sample inputs (the OpInfo database) in a private module, so
hmp writes its own: each builder takes ``g``, a source of drawn sizes,
tensors and choices (hmp/testing/strategies.py draws them with
hypothesis), and returns ``(args, kwargs)`` for the function a user calls
(entries.public_function: ``torch.nn.functional.X`` where it exists, else
``torch.X``, ``operator.X``, or for an aten name such as ``fft_rfft`` its
submodule's ``torch.fft.rfft``). Shapes are small and every call is one
torch accepts in float32; which dtype each floating tensor has is ``g``'s
choice.
hmp/testing/samples_extra.py adds the ops torch.autocast keeps in float32
(BUILDERS below includes them). tests/unit/testing/test_testing_kit.py checks that
every name of every shipped list has a builder that draws calls torch runs.
"""

import torch

from hmp.testing import samples_extra


def _mm(g):
    n, m, p = g.size(), g.size(), g.size()
    return (g.t(n, m), g.t(m, p)), {}


def _addmm(g):
    n, m, p = g.size(), g.size(), g.size()
    bias = g.t(n, p) if g.flag() else g.t(p)
    kwargs = {"beta": g.pick([1.0, 0.5]), "alpha": g.pick([1.0, 2.0])} if g.flag() else {}
    return (bias, g.t(n, m), g.t(m, p)), kwargs


def _baddbmm(g):
    b, n, m, p = g.size(), g.size(), g.size(), g.size()
    return (g.t(b, n, p), g.t(b, n, m), g.t(b, m, p)), {}


def _addbmm(g):
    b, n, m, p = g.size(), g.size(), g.size(), g.size()
    return (g.t(n, p), g.t(b, n, m), g.t(b, m, p)), {}


def _bmm(g):
    b, n, m, p = g.size(), g.size(), g.size(), g.size()
    return (g.t(b, n, m), g.t(b, m, p)), {}


def _addmv(g):
    n, m = g.size(), g.size()
    return (g.t(n), g.t(n, m), g.t(m)), {}


def _addr(g):
    n, m = g.size(), g.size()
    return (g.t(n, m), g.t(n), g.t(m)), {}


def _mv(g):
    n, m = g.size(), g.size()
    return (g.t(n, m), g.t(m)), {}


def _dot(g):
    n = g.size()
    return (g.t(n), g.t(n)), {}


def _matmul(g):
    b, n, m, p = g.size(), g.size(), g.size(), g.size()
    shapes = g.pick([((m,), (m,)), ((n, m), (m,)), ((m,), (m, p)), ((n, m), (m, p)), ((b, n, m), (m, p))])
    return (g.t(*shapes[0]), g.t(*shapes[1])), {}


def _chain(g):
    sizes = [g.size() for _ in range(4)]
    return tuple(g.t(sizes[i], sizes[i + 1]) for i in range(3)), {}


def _multi_dot(g):
    return (list(_chain(g)[0]),), {}


def _einsum(g):
    n, m, p = g.size(), g.size(), g.size()
    return ("ij,jk->ik", g.t(n, m), g.t(m, p)), {}


def _linear(g):
    n, i, o = g.size(), g.size(), g.size()
    x = g.t(*([g.size()] if g.flag() else []), n, i)
    return (x, g.t(o, i), g.t(o) if g.flag() else None), {}


def _bilinear(g):
    n, a, c, o = g.size(), g.size(), g.size(), g.size()
    return (g.t(n, a), g.t(n, c), g.t(o, a, c), g.t(o) if g.flag() else None), {}


def _conv(dims, transposed=False):
    def build(g):
        n, c, o, k = g.size(1, 2), g.size(1, 3), g.size(1, 3), g.size(1, 2)
        x = g.t(n, c, *[g.size(k, k + 2) for _ in range(dims)])
        w = g.t(c, o, *[k] * dims) if transposed else g.t(o, c, *[k] * dims)
        return (x, w, g.t(o) if g.flag() else None), {}

    return build


def _conv_tbc(g):
    t, b, c, o, k = g.size(2, 4), g.size(1, 2), g.size(1, 3), g.size(1, 3), g.size(1, 2)
    return (g.t(t, b, c), g.t(k, c, o), g.t(o)), {"pad": 0}


def _prelu(g):
    n, c = g.size(), g.size()
    return (g.t(n, c, g.size()), g.t(g.pick([1, c]))), {}


def _rnn_cell(gates):
    def build(g):
        b, i, h = g.size(), g.size(), g.size()
        hx = (g.t(b, h), g.t(b, h)) if gates == 4 else g.t(b, h)
        return (g.t(b, i), hx, g.t(gates * h, i), g.t(gates * h, h), g.t(gates * h), g.t(gates * h)), {}

    return build


def _rnn(gates):
    def build(g):
        t, b, i, h = g.size(1, 3), g.size(), g.size(), g.size()
        hx = (g.t(1, b, h), g.t(1, b, h)) if gates == 4 else g.t(1, b, h)
        params = [g.t(gates * h, i), g.t(gates * h, h), g.t(gates * h), g.t(gates * h)]
        # input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first
        return (g.t(t, b, i), hx, params, True, 1, 0.0, False, False, False), {}

    return build


def _batch_norm(g):
    n, c = g.size(2, 3), g.size()
    stats = g.flag()
    training = g.flag() or not stats
    args = (g.t(n, c, g.size()), g.t(c) if stats else None, g.t(c, positive=True) if stats else None)
    return args, {"weight": g.t(c) if g.flag() else None, "bias": g.t(c) if g.flag() else None, "training": training}


def _instance_norm(g):
    n, c = g.size(), g.size()
    return (g.t(n, c, g.size(2, 4)),), {"weight": g.t(c) if g.flag() else None, "bias": g.t(c) if g.flag() else None}


def _group_norm(g):
    groups, per = g.size(1, 2), g.size(1, 2)
    c = groups * per
    return (g.t(g.size(), c, g.size(2, 4)), groups), {"weight": g.t(c) if g.flag() else None, "bias": g.t(c)}


def _layer_norm(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    last = shape[-g.size(1, len(shape)) :]
    affine = g.flag()
    return (g.t(*shape), last), {"weight": g.t(*last) if affine else None, "bias": g.t(*last) if affine else None}


def _dropout(dims):
    def build(g):
        shape = [g.size() for _ in range(dims + 2)] if dims else [g.size() for _ in range(g.size(1, 3))]
        return (g.t(*shape),), {"p": g.pick([0.0, 0.5]), "training": g.flag()}

    return build


def _unary(positive=False):
    return lambda g: ((g.t(*[g.size() for _ in range(g.size(0, 3))], positive=positive),), {})


def _leaky_relu(g):
    return (g.t(g.size(), g.size()),), {"negative_slope": g.pick([0.01, 0.2])}


def _binary(nonzero=False, positive=False, scalar=True):
    def build(g):
        shape = [g.size() for _ in range(g.size(0, 3))]
        a = g.t(*shape, positive=positive)
        if scalar and g.flag():
            return (a, g.pick([0.5, 2.0, 3])), {}
        other = shape[len(shape) - g.size(0, len(shape)) :]  # broadcast: trailing dimensions, maybe none
        return (a, g.t(*other, nonzero=nonzero)), {}

    return build


def _pow(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    exponent = g.pick([2, 0.5]) if g.flag() else g.t(*shape)
    return (g.t(*shape, positive=True), exponent), {}


def _ternary(nonzero=False):
    def build(g):
        shape = [g.size() for _ in range(g.size(1, 3))]
        kwargs = {"value": g.pick([0.5, 2.0])} if g.flag() else {}
        return (g.t(*shape), g.t(*shape), g.t(*shape, nonzero=nonzero)), kwargs

    return build


def _lerp(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    weight = g.pick([0.25, 0.5]) if g.flag() else g.t(*shape)
    return (g.t(*shape), g.t(*shape), weight), {}


def _joined(stack):
    def build(g):
        shape = [g.size() for _ in range(g.size(1, 3))]
        if stack:
            return ([g.t(*shape) for _ in range(g.size(2, 3))],), {}
        return ([g.t(g.size(), *shape[1:]) for _ in range(g.size(2, 3))],), {}

    return build


def _where(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    return (g.mask(*shape), g.t(*shape), g.t(*shape) if g.flag() else g.pick([0.0, 1.5])), {}


def _index_put(g):
    n, k = g.size(2, 4), g.size()
    return (g.t(n), (g.idx(n, k),), g.t(k) if g.flag() else g.t()), {"accumulate": g.flag()}


def _index_into(g):
    n, m, k = g.size(2, 4), g.size(), g.size(1, 2)
    return (g.t(n, m), 0, g.distinct(n, k), g.t(k, m)), {}


def _scatter(g):
    n, m, k = g.size(2, 4), g.size(), g.size()
    return (g.t(n, m), 0, g.idx(n, k, m), g.t(k, m)), {}


def _masked_scatter(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    return (g.t(*shape), g.mask(*shape), g.t(*shape)), {}


def _avg_pool3d(g):
    return (g.t(g.size(1, 2), g.size(), 2, 2, 2),), {"kernel_size": g.pick([1, 2])}


def _probabilities(g):
    shape = [g.size() for _ in range(g.size(1, 2))]
    return (g.t(*shape, unit=True), g.t(*shape, unit=True)), {}


def _with_logits(g):
    shape = [g.size() for _ in range(g.size(1, 2))]
    return (g.t(*shape), g.t(*shape, unit=True)), {}


def _classes(g):
    n, c = g.size(), g.size(2, 4)
    if g.flag():
        return (g.t(n, c), g.t(n, c, unit=True)), {}  # class probabilities as the target
    return (g.t(n, c), g.idx(c, n)), {}


def _nll(g):
    n, c = g.size(), g.size(2, 4)
    return (g.t(n, c), g.idx(c, n)), {}


def _ctc(g):
    t, n, c, s = g.size(3, 4), g.size(1, 2), g.size(2, 4), g.size(1, 2)
    targets = g.idx(c - 1, n, s) + 1  # 0 is the blank
    lengths = torch.full((n,), t, dtype=torch.long), torch.full((n,), s, dtype=torch.long)
    return (g.t(t, n, c), targets, *lengths), {}


def _pair(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    return (g.t(*shape), g.t(*shape)), {}


def _embedding(g):
    v, d = g.size(2, 4), g.size()
    return (g.idx(v, g.size()), g.t(v, d)), {}


def _embedding_bag(g):
    v, d, n = g.size(2, 4), g.size(), g.size(2, 4)
    return (g.idx(v, n), g.t(v, d)), {"offsets": torch.tensor([0, n // 2]), "mode": g.pick(["mean", "sum"])}


def _margin(g):
    n, c = g.size(), g.size(2, 4)
    return (g.t(n, c), g.idx(c, n)), {}


def _multilabel_margin(g):
    n, c = g.size(), g.size(2, 4)
    return (g.t(n, c), g.idx(c, n, c)), {}


def _dim(positive=False):
    def build(g):
        shape = [g.size() for _ in range(g.size(1, 3))]
        return (g.t(*shape, positive=positive), g.size(0, len(shape) - 1)), {}

    return build


def _topk(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    return (g.t(*shape), g.size(1, shape[-1])), {}


def _t(g):
    return (g.t(g.size(), g.size()),), {}


def _cdist(g):
    m = g.size()
    return (g.t(g.size(), m), g.t(g.size(), m)), {}


def _pdist(g):
    return (g.t(g.size(2, 4), g.size()),), {}


def _trace(g):
    n = g.size()
    return (g.t(n, n),), {}


def _rfft(g):
    return (g.t(g.size(), g.size(2, 4)),), {}


def _quantile(g):
    return (g.t(g.size(2, 4)), g.pick([0.0, 0.25, 0.5, 1.0])), {}


BUILDERS = {
    # matrix products, convolutions, RNNs (the default BF16 lists, the FP16 list)
    "mm": _mm,
    "addmm": _addmm,
    "baddbmm": _baddbmm,
    "addbmm": _addbmm,
    "bmm": _bmm,
    "addmv": _addmv,
    "addr": _addr,
    "mv": _mv,
    "dot": _dot,
    "vdot": _dot,
    "matmul": _matmul,
    "chain_matmul": _chain,
    "linalg_multi_dot": _multi_dot,
    "einsum": _einsum,
    "linear": _linear,
    "bilinear": _bilinear,
    "conv1d": _conv(1),
    "conv2d": _conv(2),
    "conv3d": _conv(3),
    "conv_transpose1d": _conv(1, transposed=True),
    "conv_transpose2d": _conv(2, transposed=True),
    "conv_transpose3d": _conv(3, transposed=True),
    "conv_tbc": _conv_tbc,
    "prelu": _prelu,
    "lstm_cell": _rnn_cell(4),
    "gru_cell": _rnn_cell(3),
    "rnn_tanh_cell": _rnn_cell(1),
    "rnn_relu_cell": _rnn_cell(1),
    "lstm": _rnn(4),
    "gru": _rnn(3),
    "rnn_tanh": _rnn(1),
    "rnn_relu": _rnn(1),
    # what strict mode's BF16 list adds (normalisations, dropout, pointwise)
    "batch_norm": _batch_norm,
    "instance_norm": _instance_norm,
    "group_norm": _group_norm,
    "layer_norm": _layer_norm,
    "dropout": _dropout(0),
    "dropout1d": _dropout(1),
    "dropout2d": _dropout(2),
    "dropout3d": _dropout(3),
    "leaky_relu": _leaky_relu,
    "relu": _unary(),
    "mul": _binary(),
    # the FP32 lists
    "avg_pool3d": _avg_pool3d,
    "binary_cross_entropy": _probabilities,
    "binary_cross_entropy_with_logits": _with_logits,
    "cross_entropy": _classes,
    "nll_loss": _nll,
    "ctc_loss": _ctc,
    "div": _binary(nonzero=True),
    "divide": _binary(nonzero=True),
    "truediv": _binary(nonzero=True),
    "embedding": _embedding,
    "embedding_bag": _embedding_bag,
    "huber_loss": _pair,
    "mse_loss": _pair,
    "smooth_l1_loss": _pair,
    "log": _unary(positive=True),
    "log2": _unary(positive=True),
    "log_softmax": _dim(),
    "softmax": _dim(),
    "multi_margin_loss": _margin,
    "multilabel_margin_loss": _multilabel_margin,
    "topk": _topk,
    "t": _t,
    # the promote list
    "add": _binary(),
    "sub": _binary(),
    "subtract": _binary(),
    "rsub": _binary(),
    "multiply": _binary(),
    "pow": _pow,
    "atan2": _binary(scalar=False),
    "maximum": _binary(scalar=False),
    "minimum": _binary(scalar=False),
    "fmax": _binary(scalar=False),
    "fmin": _binary(scalar=False),
    "hypot": _binary(scalar=False),
    "addcmul": _ternary(),
    "addcdiv": _ternary(nonzero=True),
    "lerp": _lerp,
    "cat": _joined(stack=False),
    "concat": _joined(stack=False),
    "concatenate": _joined(stack=False),
    "stack": _joined(stack=True),
    "hstack": _joined(stack=True),
    "vstack": _joined(stack=True),
    "dstack": _joined(stack=True),
    "where": _where,
    "index_put": _index_put,
    "index_add": _index_into,
    "index_copy": _index_into,
    "scatter": _scatter,
    "scatter_add": _scatter,
    "masked_scatter": _masked_scatter,
    # a few ops without a lower-precision CPU kernel (op_lists/no_kernel_bf16.txt)
    "cdist": _cdist,
    "pdist": _pdist,
    "trace": _trace,
    "fft_rfft": _rfft,
    "quantile": _quantile,
}
BUILDERS.update(samples_extra.BUILDERS)
