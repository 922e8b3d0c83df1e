"""The floor (issue 48): the smallest Python wrapper with hmp's casts, installed where hmp installs its own.

A listed op's wrapper in hmp casts through a generic body: thread state (casts off inside an op, so the
outermost op decides), a check per call of whether torch.compile or torch.jit.trace is running, a weight
cache whose every hit is checked against the weight's version counter and data pointer, and the
guarantees that rest on them. The floor keeps only what a bf16 call must do to be as safe: the same
casts (a float32 activation to bf16 with the saturation check: on the CPU ``aminmax`` and two reads,
saturating only when a value lies beyond the range, off it hmp's one-kernel op; a Python float beyond
bf16's range leaves the call uncast, as hmp's FP32 rule takes it), weights from a dict. Nothing else:
it is a bound on what any design that wraps each listed call in Python can reach, not a replacement
(no compile, trace, thread, in-place or write-back rules).

    with floor.installed():        # hmp's default lists' sites, the floor's wrappers at each
        model(x)

``installed()`` converts once to learn the sites and each one's rule (the lean rules: BF16, FP32,
promote; a site hmp steps into only for some calls, or whose calls write a tensor, stays torch's),
reverts, and installs the floor's wrappers there until the block exits. Its dict of weight copies lives
for the block and is emptied at every optimizer step (a training step's copies belong to its graph).
"""

import contextlib

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import hmp
from hmp.binding import wrapper_life
from hmp.core import dtypes, policy
from hmp.core.saturating_cast import to_finite as _to_finite
from hmp.core.state import runtime

_F32, _BF16 = torch.float32, torch.bfloat16
_HALVES = (torch.bfloat16, torch.float16)
_TOP = torch.finfo(_BF16).max
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_bf16, _float = torch._C.TensorBase.bfloat16, torch._C.TensorBase.float
_aminmax, _where, _isinf, _clamp = torch.aminmax, torch.where, torch.isinf, torch.clamp
_grad_mode = torch._C._set_grad_enabled


def down(t):
    """A float32 activation to bf16, finite values kept finite: off the CPU, where reading the range
    would wait for the device, hmp's one op (``hmp::to_finite``: one kernel on CUDA), as hmp does."""
    if not t.is_cpu:
        return _to_finite(t, _BF16)
    y = _bf16(t)
    grad = y.requires_grad
    if grad:
        _grad_mode(False)
    try:
        lo, hi = _aminmax(t)
        if not (-_TOP <= lo.item() and hi.item() <= _TOP):
            _where(_isinf(t), y, _clamp(y, -_TOP, _TOP), out=y)
    except RuntimeError:  # empty: nothing to saturate
        pass
    finally:
        if grad:
            _grad_mode(True)
    return y


def _lower(op, weights):
    def seq(values):  # lists and tuples (torch.cat, RNN weights): not the common case
        return type(values)(one(v) for v in values)

    def one(a):
        t = type(a)
        if t is _Parameter:
            if a.dtype is _F32:
                c = weights.get(id(a))
                if c is None:
                    c = weights[id(a)] = down(a)
                return c
        elif t is _Tensor:
            if a.dtype is _F32:
                return down(a)
        elif t is list or t is tuple:
            return seq(a)
        return a

    def floor(*args, **kwargs):
        out = None
        for i, a in enumerate(args):
            t = type(a)
            if t is _Parameter:
                if a.dtype is _F32:
                    c = weights.get(id(a))
                    if c is None:
                        c = weights[id(a)] = down(a)
                    if out is None:
                        out = list(args)
                    out[i] = c
            elif t is _Tensor:
                if a.dtype is _F32:
                    if out is None:
                        out = list(args)
                    out[i] = down(a)
            elif t is float:
                if not -_TOP <= a <= _TOP:  # hmp's FP32 rule for this call; the floor runs it as given
                    return op(*args, **kwargs)
            elif t is list or t is tuple:
                if out is None:
                    out = list(args)
                out[i] = seq(a)
        if kwargs:
            kwargs = {k: one(v) for k, v in kwargs.items()}
        return op(*(args if out is None else out), **kwargs)

    return floor


def _up(op):
    def floor(*args, **kwargs):
        out = None
        for i, a in enumerate(args):
            if isinstance(a, _Tensor) and a.dtype in _HALVES:
                if out is None:
                    out = list(args)
                out[i] = _float(a)
        if kwargs:
            kwargs = {k: _float(v) if isinstance(v, _Tensor) and v.dtype in _HALVES else v for k, v in kwargs.items()}
        return op(*(args if out is None else out), **kwargs)

    return floor


def _promote(op):
    def floor(*args, **kwargs):
        seen = None
        for a in args:
            for t in a if type(a) is list or type(a) is tuple else (a,):
                if isinstance(t, _Tensor) and t.is_floating_point():
                    if seen is None:
                        seen = t.dtype
                    elif t.dtype is not seen:  # mixed: torch's type promotion, as hmp's rule gives
                        return op(*args, **kwargs)  # (not the case the benchmarks time)
        return op(*args, **kwargs)

    return floor


_SITES = {}  # the convert() arguments -> sites(): a conversion's sites do not change within a process


def sites(**convert_args):
    """(namespace, attribute, torch's op, rule) for every site hmp's lean rules wrap: ``"bf16"``,
    ``"fp32"`` or ``"promote"``. Converts and reverts (once per set of arguments)."""
    key = tuple(sorted(convert_args.items()))
    if key not in _SITES:
        _SITES[key] = _sites(convert_args)
    return _SITES[key]


def _sites(convert_args):
    found = []
    with hmp.converted(**convert_args):
        for e in runtime.undo_log.records():
            if not wrapper_life.is_wrapper(e.value):
                continue
            f = wrapper_life.fields(e.value)
            src = f["src"]
            rule = (
                "bf16"
                if src is dtypes.FP32_ONLY
                else "fp32"
                if src is dtypes.HALVES
                else "promote"
                if src is policy.PROMOTE
                else None
            )
            if rule is not None:
                found.append((e.namespace, e.attr, f["op"], rule))
    return found


@contextlib.contextmanager
def installed(**convert_args):
    """The floor's wrappers at hmp's sites for the block (hmp itself reverted)."""
    if hmp.is_converted():
        raise RuntimeError("the floor replaces hmp: revert() first")
    weights = {}
    where = [(ns, attr, getattr(ns, attr), op, rule) for ns, attr, op, rule in sites(**convert_args)]
    handle = register_optimizer_step_post_hook(lambda *_: weights.clear())
    try:
        for ns, attr, _, op, rule in where:
            setattr(ns, attr, _lower(op, weights) if rule == "bf16" else _up(op) if rule == "fp32" else _promote(op))
        yield weights
    finally:
        for ns, attr, before, _, _ in reversed(where):
            setattr(ns, attr, before)
        handle.remove()
        weights.clear()
