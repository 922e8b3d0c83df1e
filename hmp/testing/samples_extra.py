"""Builders for the ops torch.autocast keeps in float32 (op_lists/autocast_cpu_fp32.txt,
autocast_cuda_fp32.txt) and their neighbours (pools, cumulative reductions), which the
FP32 list may name: the same form as hmp/testing/samples.py's (``g`` draws sizes, tensors
and choices; a builder returns ``(args, kwargs)`` for the function ``op_for`` gives).
Linear-algebra ops that need a well-conditioned matrix get a symmetric positive-definite
one, so every drawn float32 call is one torch runs. samples.BUILDERS includes these."""

import torch
import torch.nn.functional as F


def spd(g, *batch, n):
    """A symmetric positive-definite ``n`` x ``n`` matrix (a batch of them), in a drawn dtype:
    finite and moderate whatever was drawn (LAPACK crashes the process on some NaN input)."""
    a = g.t(*batch, n, n)
    f = a.float().nan_to_num(0.0, 0.0, 0.0).clamp(-1e3, 1e3)
    return (f @ f.mT + n * torch.eye(n, device=a.device)).to(a.dtype)


def _spd(g):
    n = g.size(2, 4)
    return (spd(g, *([g.size(1, 2)] if g.flag() else []), n=n),), {}


def _lu_solve(g):
    n = g.size(2, 4)
    a = spd(g, n=n)
    lu, pivots = torch.linalg.lu_factor(a.float())
    return (g.t(n, g.size()), lu.to(a.dtype), pivots), {}


def _householder(with_c=False):
    def build(g):
        m, n = g.size(2, 4), g.size(1, 2)
        a, tau = g.t(m, n), g.t(n)
        return ((a, tau, g.t(m, g.size())) if with_c else (a, tau)), {}

    return build


def _tensorinv(g):
    return (spd(g, n=4).reshape(4, 2, 2),), {"ind": 1}


def _tensorsolve(g):
    return (spd(g, n=4).reshape(4, 2, 2), g.t(4)), {}


def _pool(dims):
    def build(g):
        x = g.t(g.size(1, 2), g.size(1, 2), *[g.size(2, 4) for _ in range(dims)])
        return (x, g.pick([1, 2])), {}

    return build


def _unpool(dims):
    pool = {2: F.max_pool2d, 3: F.max_pool3d}[dims]

    def build(g):
        x = g.t(g.size(1, 2), g.size(1, 2), *[4] * dims)
        pooled, indices = pool(x.float(), 2, return_indices=True)
        return (pooled.to(x.dtype), indices, 2), {}

    return build


def _fractional(dims):
    def build(g):
        return (g.t(g.size(1, 2), g.size(1, 2), *[5] * dims), 2), {"output_size": g.pick([2, 3])}

    return build


def _grid(dims):
    def build(g):
        n, c = g.size(1, 2), g.size(1, 2)
        x = g.t(n, c, *[g.size(2, 4) for _ in range(dims)])
        grid = g.t(n, *[g.size(1, 3) for _ in range(dims)], dims, unit=True) * 2 - 1  # in [-1, 1]
        return (x, grid, g.pick([0, 1]), g.pick([0, 1]), g.flag()), {}

    return build


def _dims_reduce(keyword=False):
    def build(g):
        shape = [g.size() for _ in range(g.size(1, 3))]
        dim = g.size(0, len(shape) - 1)
        return (g.t(*shape), [dim] if keyword else dim), {}

    return build


def _cosine_embedding(g):
    n, d = g.size(), g.size()
    return (g.t(n, d), g.t(n, d), g.idx(2, n) * 2 - 1), {}


def _fake_quantize(g):
    return (g.t(g.size(), g.size()), g.pick([0.1, 1.0]), 0, 0, 255), {}


def _stft(g):
    return (g.t(g.size(1, 2), g.size(8, 12)), 4), {"return_complex": True}


def _nanquantile(g):
    return (g.t(g.size(2, 4)), g.pick([0.0, 0.5, 1.0])), {}


def _native_layer_norm(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    last = shape[-1:]
    return (g.t(*shape), last, g.t(*last), g.t(*last), 1e-5), {}


def _rms_norm(g):
    shape = [g.size() for _ in range(g.size(1, 3))]
    return (g.t(*shape), shape[-1:]), {}


def _renorm(g):
    return (g.t(g.size(), g.size()), 2, 0, g.pick([0.5, 1.0])), {}


def _frobenius(g):
    return (g.t(g.size(), g.size()), [0, 1]), {}


def _pad(dims):
    return lambda g: ((g.t(g.size(1, 2), g.size(1, 2), *[g.size(2, 3) for _ in range(dims)]), [1] * 2 * dims), {})


def _nll2d(g):
    n, c, h, w = g.size(1, 2), g.size(2, 3), g.size(1, 3), g.size(1, 3)
    # input, target, weight, reduction (1: mean), ignore_index
    return (g.t(n, c, h, w), g.idx(c, n, h, w), None, 1, -100), {}


def _upsample(dims, corners=False):
    def build(g):
        x = g.t(g.size(1, 2), g.size(1, 2), *[g.size(1, 3) for _ in range(dims)])
        size = [g.size(2, 4) for _ in range(dims)]
        return ((x, size, g.flag()) if corners else (x, size)), {}

    return build


BUILDERS = {
    "cholesky": _spd,
    "linalg_cholesky": _spd,
    "linalg_cholesky_ex": _spd,
    "cholesky_inverse": _spd,
    "inverse": _spd,
    "linalg_inv": _spd,
    "linalg_inv_ex": _spd,
    "lu_solve": _lu_solve,
    "linalg_householder_product": _householder(),
    "orgqr": _householder(),
    "ormqr": _householder(with_c=True),
    "linalg_tensorinv": _tensorinv,
    "linalg_tensorsolve": _tensorsolve,
    "max_pool1d": _pool(1),
    "max_pool2d": _pool(2),
    "max_pool3d": _pool(3),
    "avg_pool1d": _pool(1),
    "avg_pool2d": _pool(2),
    "adaptive_avg_pool1d": _pool(1),
    "adaptive_avg_pool2d": _pool(2),
    "adaptive_avg_pool3d": _pool(3),
    "adaptive_max_pool1d": _pool(1),
    "adaptive_max_pool2d": _pool(2),
    "adaptive_max_pool3d": _pool(3),
    "max_unpool2d": _unpool(2),
    "max_unpool3d": _unpool(3),
    "fractional_max_pool2d": _fractional(2),
    "fractional_max_pool3d": _fractional(3),
    "grid_sampler": _grid(2),
    "grid_sampler_2d": _grid(2),
    "grid_sampler_3d": _grid(3),
    "_grid_sampler_2d_cpu_fallback": _grid(2),
    "cumsum": _dims_reduce(),
    "cumprod": _dims_reduce(),
    "logsumexp": _dims_reduce(),
    "frobenius_norm": _frobenius,
    "cosine_embedding_loss": _cosine_embedding,
    "fake_quantize_per_tensor_affine": _fake_quantize,
    "stft": _stft,
    "nanquantile": _nanquantile,
    "native_layer_norm": _native_layer_norm,
    "rms_norm": _rms_norm,
    "renorm": _renorm,
    "reflection_pad1d": _pad(1),
    "reflection_pad2d": _pad(2),
    "reflection_pad3d": _pad(3),
    "replication_pad1d": _pad(1),
    "replication_pad2d": _pad(2),
    "replication_pad3d": _pad(3),
    "nll_loss2d": _nll2d,
    "upsample_nearest1d": _upsample(1),
    "upsample_nearest2d": _upsample(2),
    "upsample_nearest3d": _upsample(3),
    "_upsample_nearest_exact1d": _upsample(1),
    "_upsample_nearest_exact2d": _upsample(2),
    "_upsample_nearest_exact3d": _upsample(3),
    "upsample_linear1d": _upsample(1, corners=True),
    "upsample_bilinear2d": _upsample(2, corners=True),
    "upsample_bicubic2d": _upsample(2, corners=True),
    "upsample_trilinear3d": _upsample(3, corners=True),
    "_upsample_bilinear2d_aa": _upsample(2, corners=True),
    "_upsample_bicubic2d_aa": _upsample(2, corners=True),
}


def _bn_args(g, stats):
    n, c = g.size(2, 3), g.size()
    x, weight, bias = g.t(n, c, g.size()), g.t(c), g.t(c)
    if stats:
        return x, weight, bias, g.t(c), g.t(c, positive=True)
    return x, None, None, None, None


def _embedding_bag_torch(g):
    v, d, n = g.size(2, 4), g.size(), g.size(2, 4)
    # weight, indices, offsets, scale_grad_by_freq, mode (0: sum, 1: mean), sparse
    indices = g.idx(v, n)
    offsets = torch.tensor([0, n // 2], device=indices.device)
    return (g.t(v, d), indices, offsets, False, g.pick([0, 1]), False), {}


def _lu_solve_linalg(g):
    (b, lu, pivots), _ = _lu_solve(g)
    return (lu, pivots, b), {}


# spellings whose arguments differ from the list name's function (op_for): by the path a user writes
SPELLED = {
    "torch.dropout": lambda g: ((g.t(g.size(), g.size()), g.pick([0.0, 0.5]), g.flag()), {}),
    "torch.batch_norm": lambda g: ((*_bn_args(g, True), g.flag(), 0.1, 1e-5, False), {}),
    "torch.instance_norm": lambda g: ((*_bn_args(g, False), True, 0.1, 1e-5, False), {}),
    "torch.embedding": lambda g: (lambda v: ((g.t(v, g.size()), g.idx(v, g.size())), {}))(g.size(2, 4)),
    "torch.embedding_bag": _embedding_bag_torch,
    "torch.linalg.lu_solve": _lu_solve_linalg,
    # input, target, log_input, full, eps, reduction (1: mean)
    "torch.poisson_nll_loss": lambda g: (lambda s: ((g.t(*s), g.t(*s, positive=True), True, False, 1e-8, 1), {}))(
        [g.size(), g.size()]
    ),
    "torch.Tensor.where": lambda g: (lambda s: ((g.t(*s), g.mask(*s), g.t(*s)), {}))([g.size(), g.size()]),
}
