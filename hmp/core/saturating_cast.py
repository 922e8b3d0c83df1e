"""The saturating cast off the CPU as one op, ``hmp::to_finite``: a finite value stays
finite (docs/never-changes.md). On the CPU hmp reads the source's range first
(cast_copies.py); off it a read would sync the device, so the cast always saturates.
One registered op, so a dispatch mode sees one op and each device gives its kernel:

- CUDA/ROCm with Triton: one Triton kernel, bf16 rounding done on the bits (round to
  nearest even), so Triton's interpreter gives the same bits as a GPU.
- Meta and fake tensors: metadata only.
- Other devices, or a source the kernel does not take: the stock ops.

Inside torch.compile and jit.trace hmp emits the stock ops (cast_copies.py) for
inductor to fuse."""

import functools

import torch

from hmp.core import torch_private, triton_launch
from hmp.core.dtypes import FLOATS, LOW

_TB = torch_private.TensorBase
_KERNEL_DTYPES = LOW  # the Triton kernel's targets
# the op's targets: any floating dtype torch computes in, with its largest finite value
_TOPS = {d: torch.finfo(d).max for d in FLOATS}
_isinf, _clamp, _where, _to = torch.isinf, torch.clamp, torch.where, _TB.to
_F32 = torch.float32
BLOCK = 1024

_lib = torch.library.Library("hmp", "FRAGMENT")  # hmp's own namespace: its one op, defined at import
_lib.define("to_finite(Tensor self, ScalarType dtype) -> Tensor")


def _top(t, dtype):
    """``dtype``'s largest finite value, None when ``t``'s own range fits in it (nothing to
    saturate); a clear error for a dtype the op does not cast to."""
    top = _TOPS.get(dtype)
    if top is None:
        raise TypeError(f"hmp::to_finite casts to a floating dtype (bfloat16, float16, float32, float64); got {dtype}")
    src = _TOPS.get(t.dtype)
    return None if src is not None and src <= top or not t.is_floating_point() else top


def stock(t, dtype):
    """The cast in torch's ops: round, then a finite value beyond the range (inf after rounding)
    becomes the largest finite value; an infinity stays infinite, NaN stays NaN. Four ops (one
    where the source's range fits in the target's)."""
    top = _top(t, dtype)
    y = _to(t, dtype)
    if top is not None:
        try:
            _where(_isinf(t), y, _clamp(y, -top, top), out=y)
        except (RuntimeError, NotImplementedError):  # a layout without these ops (nested): torch's rounding
            pass
    return y


def differentiable(t, dtype):
    """The same values with the plain cast's gradient, in torch's differentiable ops, forward mode,
    vmap and functorch's transforms included: the op's autograd kernel (``_autograd``)."""
    y = _to(t, dtype)
    top = _top(t, dtype)
    if top is None:
        return y
    with torch.no_grad():
        beyond = _isinf(y) & ~_isinf(t)  # finite values the rounding took to inf
        top_values = _clamp(y, -top, top)
    # there the largest finite value, plus a zero that carries the cast's gradient and tangent
    return _where(beyond, top_values + _to(t - t.detach(), dtype), y)


# kept: the Triton kernel, imported once
@functools.lru_cache(maxsize=None)
def kernel():
    """``(triton, the kernel)``, imported on the first cast on CUDA; None where Triton is not importable."""
    try:
        from hmp.core import saturating_kernel
    except ImportError:
        return None
    return saturating_kernel.triton, saturating_kernel.to_finite_kernel


# kept: the kernel's launcher, made once; its compiled kernels are Triton's own, per specialisation
@functools.lru_cache(maxsize=None)
def launcher():
    """The kernel's launcher (triton_launch.py: the JIT's launch first, then the compiled kernel's
    own), made on the first cast on CUDA; None where Triton is not importable."""
    found = kernel()
    return None if found is None else triton_launch.Launcher(*found, BLOCK)


STOCK_OPS = 4  # _to_copy, isinf, clamp, where


def launch(src, dst):
    """One Triton kernel: the float32 ``src`` into ``dst`` (both contiguous, same shape, not empty)."""
    dtype = dst.dtype
    launcher()(src, dst, src.numel(), _TOPS[dtype], dtype is torch.bfloat16)
    return dst


def _by_stride(t):
    """The permutation that lays a dense tensor out contiguously (strides descending), or None when
    ``t`` is not dense (a slice with gaps, a broadcast): its elements are then not one run of memory."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return order if t.permute(order).is_contiguous() else None


def cuda_kernels(t, dtype):
    """The kernel launches the cast of ``t`` makes on CUDA (Triton ships with torch's CUDA builds):
    one for a dense float32 source, in any order of its dimensions (as torch's cast keeps it); two
    for one with gaps (a contiguous copy, then the kernel); the stock ops' four for other dtypes."""
    if t.dtype is not _F32 or t.numel() == 0:
        return STOCK_OPS
    return 1 if t.is_contiguous() or _by_stride(t) is not None else 2


def _cast(t, dtype):
    if t.is_contiguous():
        return launch(t, torch.empty_like(t, dtype=dtype))
    order = _by_stride(t)
    if order is None:  # not one run of memory: a contiguous copy first, as torch's cast makes one
        return launch(t.contiguous(), torch.empty(t.shape, dtype=dtype, device=t.device))
    y = torch.empty_like(t, dtype=dtype)  # a dense tensor's copy keeps its strides, as torch's cast does
    launch(t.permute(order), y.permute(order))
    return y


_current_device = torch_private.cuda_device or torch.cuda.current_device


def _cuda(t, dtype):
    if t.dtype is not _F32 or dtype not in _KERNEL_DTYPES or t.numel() == 0 or kernel() is None:
        return stock(t, dtype)
    index = t.get_device()
    if index == _current_device():
        return _cast(t, dtype)
    with torch.cuda.device(index):  # Triton launches on the current device
        return _cast(t, dtype)


def _meta(t, dtype):
    if dtype not in _TOPS:
        _top(t, dtype)  # the error
    return torch.empty_like(t, dtype=dtype)


_below_autograd, _transforms_active = torch_private.below_autograd, torch_private.functorch_transforms_active
_forward_ad_level, _grad_enabled = torch_private.forward_ad_level, torch.is_grad_enabled


def _autograd(t, dtype):
    """The op called where autograd may see it (a direct call, a transform): with a gradient or a
    tangent to carry, torch's differentiable ops; else the device's kernel, below autograd. hmp's
    own eager casts never come here (``run``, ``apply``)."""
    if t.requires_grad and _grad_enabled() or _transforms_active() or _forward_ad_level() >= 0:
        return differentiable(t, dtype)
    with _below_autograd():
        return op(t, dtype)


_lib.impl("to_finite", _cuda, "CUDA")
_lib.impl("to_finite", _meta, "Meta")
_lib.impl("to_finite", stock, "CompositeExplicitAutograd")
_lib.impl("to_finite", _autograd, "Autograd")

op = torch.ops.hmp.to_finite.default
_modes, _grad_enabled = torch_private.dispatch_modes, torch.is_grad_enabled


def run(t, dtype):
    """The op on a plain tensor in eager code, outside autograd: where a dispatch mode is in force it
    sees the one op, ``hmp::to_finite``; else a CUDA or meta tensor's kernel is called directly (the
    op's dispatch into a Python kernel costs a GPU's host several microseconds); other devices take
    the op. The device is read by its flags: ``t.device.type`` builds a device and its name per call,
    about six times the cost."""
    if _modes():
        return op(t, dtype)
    if t.is_cuda:
        return _cuda(t, dtype)
    return _meta(t, dtype) if t.is_meta else op(t, dtype)


class _ToFinite(torch.autograd.Function):
    """The op with the plain cast's gradient (forward mode too), old-style and applied
    through torch's C ``apply``: one Python frame per cast. Its body is ``run``'s, inlined."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.src, ctx.dst = t.dtype, dtype
        if _modes():
            return op(t, dtype)
        if t.is_cuda:
            return _cuda(t, dtype)
        return _meta(t, dtype) if t.is_meta else op(t, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.src), None

    @staticmethod
    def jvp(ctx, tangent, _):
        return tangent.to(ctx.dst)


apply = torch_private.function_apply(_ToFinite)


def to_finite(t, dtype):
    """The saturating cast of ``t`` as one op, with the plain cast's gradient where one is wanted;
    under a functorch transform or forward-mode AD, the op as a direct call takes it."""
    if _transforms_active() or _forward_ad_level() >= 0:
        return op(t, dtype)
    if t.requires_grad and _grad_enabled():
        return apply(t, dtype)
    return run(t, dtype)
