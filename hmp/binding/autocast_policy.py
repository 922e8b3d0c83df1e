"""What torch.autocast does with a listed op, probed on the installed torch (engine="autocast",
hmp/binding/engine.py): its policy (``policy``) and whether it gives what hmp's rule gives for
every mix of input dtypes (``agrees``).

Autocast's policy is not read from its C++: ops with an ``Autocast<device>`` kernel come from the
dispatcher, and each listed one is called once per process on tiny tensors under autocast to read
"bf16", "fp32" or "promote". An op with no probe (``_PROBES``) keeps hmp's wrapper.

Agreeing on float32 inputs is not enough: autocast casts every floating input but float64 (a
float16 one to bfloat16 too; its promotion refuses float16 beside bfloat16), where hmp's lower
rule casts float32 alone and keeps the author's float16. So ``agrees`` runs the op on every mix
of FLOATS over its floating arguments, under autocast and through the very wrapper hmp would
install (its rule, its retry, its rescue), with autocast off; an op is delegated only where every
mix gives the same dtype and bits, or raises the same exception. The probes run in a thread of
their own: nothing of the converting thread's state (hmp's, autocast's, grad mode) reaches them."""

import _thread
import dataclasses
import functools
import itertools
import threading

import torch

from hmp.binding import sites, spellings
from hmp.binding.resolve import BUILTINS, Binding
from hmp.core import torch_private
from hmp.core.cast_copies import FINITE_CASTS
from hmp.core.dtypes import BF16, FP16, FP32, FP64


def _gemm(t):
    return t(2, 3), t(3, 4)


def _conv(dims):
    return lambda t: (t(1, 1, *(4,) * dims), t(1, 1, *(2,) * dims))


def _pair(t):
    return t(3), t(3)


# aten op -> its probe's arguments, given ``t(*shape)`` (a floating tensor of the probe's dtype)
_PROBES = {
    "linear": lambda t: (t(2, 3), t(4, 3)),
    "mm": _gemm,
    "matmul": _gemm,
    "bmm": lambda t: (t(1, 2, 3), t(1, 3, 4)),
    "addmm": lambda t: (t(2, 4), *_gemm(t)),
    "_addmm_activation": lambda t: (t(2, 4), *_gemm(t)),
    "baddbmm": lambda t: (t(1, 2, 4), t(1, 2, 3), t(1, 3, 4)),
    "addbmm": lambda t: (t(2, 4), t(1, 2, 3), t(1, 3, 4)),
    "mv": lambda t: (t(2, 3), t(3)),
    "addmv": lambda t: (t(2), t(2, 3), t(3)),
    "addr": lambda t: (t(2, 3), t(2), t(3)),
    "dot": _pair,
    "vdot": _pair,
    "linalg_vecdot": _pair,
    "prelu": lambda t: (t(1, 2, 3), t(2)),
    "lstm_cell": lambda t: (t(1, 3), [t(1, 2), t(1, 2)], t(8, 3), t(8, 2)),
    "gru_cell": lambda t: (t(1, 3), t(1, 2), t(6, 3), t(6, 2)),
    "rnn_tanh_cell": lambda t: (t(1, 3), t(1, 2), t(2, 3), t(2, 2)),
    "rnn_relu_cell": lambda t: (t(1, 3), t(1, 2), t(2, 3), t(2, 2)),
    "cat": lambda t: ([t(2), t(2)],),
    "stack": lambda t: ([t(2), t(2)],),
    "mse_loss": _pair,
    "l1_loss": _pair,
    "smooth_l1_loss": _pair,
    "huber_loss": _pair,
    "soft_margin_loss": _pair,
    "binary_cross_entropy_with_logits": _pair,
    "prod": lambda t: (t(3),),
    "trace": lambda t: (t(2, 2),),
    "cdist": lambda t: (t(2, 3), t(2, 3)),
    "softmax": lambda t: (t(3), 0),
    "log_softmax": lambda t: (t(3), 0),
}
for _dims in (1, 2, 3):
    _PROBES[f"conv{_dims}d"] = _PROBES[f"conv_transpose{_dims}d"] = _conv(_dims)

# the floating dtypes a user's tensors may hold, each mix of them over an op's floating arguments probed
MIXED = (FP32, BF16, FP16, FP64)


def _under_autocast(device, low, call):
    """``call()`` with autocast on for ``device`` in ``low``, its weight cache off; the state put back."""
    found = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, low)
    torch.set_autocast_cache_enabled(False)
    try:
        return call()
    finally:
        torch.set_autocast_enabled(device, found[0])
        torch.set_autocast_dtype(device, found[1])
        torch.set_autocast_cache_enabled(found[2])


def _maker(device, dtypes, seed=0):
    """``t(*shape)`` for a probe: the i-th floating argument in ``dtypes[i]`` (the last for the rest)."""
    made = []

    def t(*shape):
        g = torch.Generator().manual_seed(seed + len(made))
        dtype = dtypes[min(len(made), len(dtypes) - 1)]
        made.append(dtype)
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    return t, made


# kept: what torch.autocast does with an op on a device, probed once
@functools.lru_cache(maxsize=None)
def policy(name, device, low=BF16):
    """What autocast does on ``device`` with aten op ``name``: "bf16" (casts to
    ``low``), "fp32", "promote", or None (no kernel, no probe, or neither)."""
    if name not in _PROBES or name not in torch_private.autocast_kernels(device):
        return None
    op = getattr(torch.ops.aten, name)

    def dtype_of(dtypes):
        out = _outcome(lambda: op(*_PROBES[name](_maker(device, dtypes)[0])), device, low)
        return out[0] if not isinstance(out, str) else None

    if dtype_of((FP32,)) == low:
        return "bf16"
    if dtype_of((low,)) == FP32:
        return "fp32"
    if dtype_of((low, FP32)) == FP32:
        return "promote"
    return None


def _outcome(call, device=None, low=None):
    """``call()``'s first output as ``(dtype, values)``, or its exception's type name; under
    autocast when ``device`` is given."""
    try:
        out = call() if device is None else _under_autocast(device, low, call)
    except Exception as e:
        return type(e).__name__
    first = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(first, torch.Tensor):
        return type(first).__name__
    return first.dtype, first.detach().cpu().double()


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a[0] == b[0] and a[1].shape == b[1].shape and bool(((a[1] == b[1]) | (a[1].isnan() & b[1].isnan())).all())


def _calls(resolver, kind, name, low, strict, wrapped):
    """``(torch's, hmp's)``: the op at its first site (a builtin where it has one) and what hmp
    runs there, the wrapper it would install (``wrapped``) or the op itself (an entry torch's
    own promotion serves); None where torch has no such op."""
    found = sorted(
        (s for s in resolver.sites(name) if not s.inplace), key=lambda s: not isinstance(s.original(), BUILTINS)
    )
    if not found:
        return None
    site = found[0]
    original = site.original()
    if not wrapped:
        return original, original
    # labelled apart: a note the probe's rescue gives once is not the user's site's
    probe_site = dataclasses.replace(site, owner=f"hmp's probe of {site.owner}")
    wrappers = sites.Wrappers(low, dict(FINITE_CASTS), strict=strict)
    return original, wrappers.site(Binding(probe_site, kind, name), original)


# kept: whether autocast gives what hmp's rule gives for an op, probed once per rule, device and dtype
_agreed = {}  # (kind, name, device, low, strict, wrapped) -> bool


def agrees(resolver, kind, name, device, low, strict, wrapped):
    """Whether ``name`` under autocast on ``device`` (in ``low``) gives what hmp gives for it on
    list ``kind`` (``_calls``) with autocast off, for every mix of MIXED over its floating
    arguments. Run it in a clean thread (``in_clean_thread``): hmp's wrapper reads the thread's state."""
    key = (kind, name, device, low, strict, wrapped)
    if key not in _agreed:
        calls = _calls(resolver, kind, name, low, strict, wrapped)
        _agreed[key] = calls is not None and _every_mix_agrees(*calls, _PROBES[name], device, low)
    return _agreed[key]


def _every_mix_agrees(op, hmp_op, build, device, low):
    t, made = _maker(device, (FP32,))
    build(t)
    for mix in itertools.product(MIXED, repeat=len(made)):
        theirs = _outcome(lambda m=mix: op(*build(_maker(device, m)[0])), device, low)
        ours = _outcome(lambda m=mix: hmp_op(*build(_maker(device, m)[0])))
        if not _same(theirs, ours):
            return False
    return True


def in_clean_thread(fn):
    """``fn()`` run in a thread of its own, started below threading (so no conversion's thread
    start joins an engine): hmp's and autocast's thread state there are the defaults."""
    done, box = threading.Event(), {}

    def run():
        try:
            with spellings.probing():
                box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            done.set()

    _thread.start_new_thread(run, ())  # (a probe's warnings silenced there: spellings.probing)
    done.wait()
    if "error" in box:
        raise box["error"]
    return box["value"]
