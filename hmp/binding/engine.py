"""engine="autocast" at convert time: which listed ops torch.autocast casts as the lists
say (delegated: no wrapper), which it casts that the lists do not (autocast off around
them), and the changes that program each thread (docs/engines.md; per call:
hmp/core/delegation.py).

Autocast's policy is probed, not read from its C++: ops with an ``Autocast<device>``
kernel come from the dispatcher; each listed one is called once per process on tiny
tensors under autocast (``policy``) to read "bf16", "fp32" or "promote". An op with
no probe (``_PROBES``) keeps hmp's wrapper; an op is delegated where every device the
engine programs agrees with the lists."""

import functools
import threading
import types
from typing import NamedTuple

import torch

from hmp.binding.kinds import PROMOTE
from hmp.binding.wrapper_life import adapt
from hmp.core import torch_private
from hmp.core.delegation import AROUND, Engine, copies_keep_graphs, dropping, joining, off_around, uncached
from hmp.core.identity import unwrap
from hmp.core.state import runtime, tls, weight_cache

ENGINES = ("python", "autocast")
DELEGATED = "cast: torch.autocast's dispatcher (engine='autocast')"
WRAPPED = "cast: hmp's wrapper (engine='autocast')"


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


def devices():
    """The devices whose autocast the engine programs: the CPU, and CUDA where it is available."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


# kept: what torch.autocast does with an op on a device, probed once
@functools.lru_cache(maxsize=None)
def policy(name, device, low=torch.bfloat16):
    """What autocast does on ``device`` with aten op ``name``: "bf16" (casts to
    ``low``), "fp32", "promote", or None (no kernel, no probe, or neither)."""
    if name not in _PROBES or name not in torch_private.autocast_kernels(device):
        return None
    op = getattr(torch.ops.aten, name)
    if _probe(op, _PROBES[name], device, low, (torch.float32,)) == low:
        return "bf16"
    if _probe(op, _PROBES[name], device, low, (low,)) == torch.float32:
        return "fp32"
    if _probe(op, _PROBES[name], device, low, (low, torch.float32)) == torch.float32:
        return "promote"
    return None


def _probe(op, build, device, low, dtypes):
    """The dtype of ``op``'s first output under autocast on ``device``, its
    floating arguments in ``dtypes`` (the last for the rest); None if it raises."""
    made = []

    def t(*shape):
        made.append(None)
        return torch.ones(shape, dtype=dtypes[min(len(made), len(dtypes)) - 1], device=device)

    found = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, low)
    torch.set_autocast_cache_enabled(False)
    try:
        out = op(*build(t))
    except Exception:
        return None
    finally:
        torch.set_autocast_enabled(device, found[0])
        torch.set_autocast_dtype(device, found[1])
        torch.set_autocast_cache_enabled(found[2])
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.dtype if isinstance(first, torch.Tensor) else None


# kept: one engine per devices and dtype, so a thread that joined stays joined across conversions
_engines = {}  # (devices, dtype) -> Engine


def engine_for(devices, dtype):
    """The Engine for ``devices`` and ``dtype``: the same object for every
    conversion, so a thread that joined one stays joined in the next."""
    key = (tuple(devices), dtype)
    if key not in _engines:
        _engines[key] = Engine(*key)
    return _engines[key]


def in_force():
    """The Engine in force, or None (engine="python", or not converted)."""
    return next((e for e in _engines.values() if e.in_force), None)


def plain(op):
    """``op`` without an ``off_around`` layer."""
    return getattr(op, AROUND, op)


class Delegation(NamedTuple):
    """What a conversion leaves to torch.autocast: its engine and the names (kind name -> names)."""

    engine: object  # delegation.Engine
    names: dict
    cache: bool = False  # autocast's weight cache on (convert's cache=)
    model: object = None  # a weak reference to convert(model=...)'s model, or None


def decide(options, bound, effective):
    """The conversion's Delegation (None for engine="python"): ``bound``
    (kinds.Kind -> the names hmp would wrap) decides which names autocast
    casts instead; a promote entry hmp leaves to torch's own type promotion
    is left to autocast's (the same dtype, the same values)."""
    if options.engine != "autocast":
        return None
    on = devices()
    names = {}
    listed = [(kind.name, names) for kind, names in bound.items()] + [("promote", effective.get(PROMOTE, ()))]
    for kind, entries in listed:
        for name in entries:
            if all(policy(name, d, options.low_precision_type) == kind for d in on):
                names.setdefault(kind, set()).add(name)
    names = {k: frozenset(v) for k, v in names.items()}
    return Delegation(engine_for(on, options.low_precision_type), names, options.cache, options.model)


def wraps(delegated, binding):
    """Whether a resolve.Binding keeps hmp's wrapper: all do but a delegated
    entry's own sites and spellings (one decided per call keeps its wrapper)."""
    if delegated is None or binding.kind is None or binding.picks:
        return True
    return binding.name not in delegated.names.get(binding.kind.name, ())


def changes(delegated, resolver, op_sites):
    """What the engine changes, ``(patches, hooks)`` as a rule's Changes: each
    op hmp wraps runs with autocast off (its wrapper's op, changed here, before
    anything is installed), so do the other ops autocast casts, a thread
    started while converted joins the engine, and so does the converting thread."""
    if delegated is None:
        return (), ()
    engine = delegated.engine
    for _, _, wrapper in op_sites:
        adapt(wrapper, functools.partial(off_around, devices=engine.devices))
    wrapped = {(id(ns), attr) for ns, attr, _ in op_sites}
    left = (
        set().union(*(torch_private.autocast_kernels(d) for d in engine.devices)).difference(*delegated.names.values())
    )
    patches = []
    for name in sorted(left):
        for site in resolver.sites(name):
            key, original = (id(site.namespace), site.attr), site.original()
            if key in wrapped or isinstance(original, types.FunctionType):
                continue  # hmp's wrapper, or a Python function that reaches the builtin
            wrapped.add(key)
            patches.append((site.namespace, site.attr, off_around(original, engine.devices)))
    start = unwrap(threading.Thread.__dict__["_bootstrap_inner"])
    patches.append((threading.Thread, "_bootstrap_inner", joining(start, engine)))
    patches += _copies(delegated)
    return tuple(patches), (functools.partial(_Joined, delegated),)


def _copies(delegated):
    """The writes hmp sees only here, for autocast's weight cache: ``Module._apply`` (``model.to()``,
    ``.float()``, ``to_empty``) and ``torch.utils.swap_tensors`` (which refuses a tensor autocast's
    cache points to) drop its copies; ``Module._slow_forward`` (torch.jit.trace's) runs with the
    cache off."""
    if not delegated.cache:
        return []
    module = torch.nn.Module
    apply_, traced = torch_private.MODULE_APPLY, torch_private.MODULE_TRACED_FORWARD
    return [
        (module, apply_, dropping(unwrap(module.__dict__[apply_]))),
        (torch.utils, "swap_tensors", dropping(unwrap(torch.utils.swap_tensors))),
        (module, traced, uncached(unwrap(module.__dict__[traced]))),
    ]


class _Joined:
    """The engine in force and the converting thread joined; ``remove()``
    (revert(), in the reverting thread) undoes both."""

    def __init__(self, delegated):
        self.engine = engine = delegated.engine
        engine.delegated, engine.in_force = delegated.names, True
        # autocast's cache on in joined threads, and the model whose weights are checked
        engine.cache, engine.model, engine.seen = delegated.cache, delegated.model, None
        if delegated.cache:
            copies_keep_graphs()  # probed now, outside any region or compiled code
        weight_cache.autocasts = engine if delegated.cache else None
        torch.clear_autocast_cache()
        if tls.engine is engine:  # joined already: its cache follows
            torch.set_autocast_cache_enabled(delegated.cache)
        engine.join(tls)
        for wrapper in list(runtime.decorated):  # @hmp.*_function bodies: their ops run as in any hmp wrapper
            adapt(wrapper, functools.partial(off_around, devices=engine.devices))

    def remove(self):
        self.engine.in_force, self.engine.delegated = False, {}
        if weight_cache.autocasts is self.engine:  # no copy of autocast's is kept past the conversion
            weight_cache.autocasts = None
        self.engine.seen = None
        torch.clear_autocast_cache()
        self.engine.depart(tls)
        for wrapper in list(runtime.decorated):
            adapt(wrapper, plain)


def says(decided):
    """``effective_lists(detail=True)``'s entries under the engine in force: which engine casts each."""
    engine = in_force()
    if engine is None:
        return decided
    out = {}
    for kind, entries in decided.items():
        ours = engine.delegated.get(kind, ())
        out[kind] = {n: (DELEGATED if n in ours else WRAPPED) if why == "cast" else why for n, why in entries.items()}
    return out
