"""engine="autocast" at convert time: which listed ops torch.autocast casts as hmp would
(delegated: no wrapper), which ops it acts on that the lists leave alone (autocast off around
them), and the changes that program each thread (docs/engines.md; per call:
hmp/core/delegation.py).

An entry is delegated where, on every device the engine programs, autocast gives what hmp's
rule gives for every mix of input dtypes (hmp/binding/autocast_policy.py). Every other op
autocast would act on, by a kernel of its own or inside a composite that reaches one
(hmp/binding/autocast_reach.py), runs with autocast off: hmp's wrapper, or a small one at its
builtin sites."""

import functools
import threading
import types
from typing import NamedTuple

import torch

from hmp.binding import autocast_policy, autocast_reach
from hmp.binding.kinds import LOWER, PROMOTE
from hmp.binding.resolve import Site
from hmp.core import torch_private
from hmp.core.delegation import Engine, copies_keep_graphs, dropping, joining, off_around, uncached
from hmp.core.identity import unwrap
from hmp.core.state import tls, weight_cache

ENGINES = ("python", "autocast")
DELEGATED = "cast: torch.autocast's dispatcher (engine='autocast')"
WRAPPED = "cast: hmp's wrapper (engine='autocast')"
ACTS = "torch.autocast acts on it, as torch's promotion would (engine='autocast')"
OFF = "torch.autocast off around it (engine='autocast')"


def devices():
    """The devices whose autocast the engine programs: the CPU, and CUDA where it is available."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


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


class Delegation(NamedTuple):
    """What a conversion leaves to torch.autocast: its engine and the names (kind name -> names)."""

    engine: object  # delegation.Engine
    names: dict
    cache: bool = False  # autocast's weight cache on (convert's cache=)
    model: object = None  # a weak reference to convert(model=...)'s model, or None


def decide(options, bound, effective, resolver):
    """The conversion's Delegation (None for engine="python"): ``bound``
    (kinds.Kind -> the names hmp would wrap) decides which names autocast
    casts instead; a promote entry hmp leaves to torch's own type promotion
    is left to autocast's where that gives the same for every mix of dtypes."""
    if options.engine != "autocast":
        return None
    on, low = devices(), options.low_precision_type
    promote = [n for n in effective.get(PROMOTE, ()) if n not in bound.get(PROMOTE, ())]
    listed = [(kind, name, True) for kind, names in bound.items() for name in names]
    listed += [(PROMOTE, name, False) for name in promote]
    # autocast's policy is the list's on float32 inputs, then on every mix, in a thread with no state of ours;
    # never an op that casts down: autocast's cast rounds a finite float32 past the lower dtype's range to
    # inf where hmp's saturates (never-changes.md), which no probe on ordinary values would see
    candidates = [
        e for e in listed if e[0] is not LOWER and all(autocast_policy.policy(e[1], d, low) == e[0].name for d in on)
    ]

    def agreed():
        return [
            (kind, name)
            for kind, name, wrapped in candidates
            if all(autocast_policy.agrees(resolver, kind, name, d, low, options.strict, wrapped) for d in on)
        ]

    names = {}
    for kind, name in autocast_policy.in_clean_thread(agreed) if candidates else ():
        names.setdefault(kind.name, set()).add(name)
    names = {k: frozenset(v) for k, v in names.items()}
    return Delegation(engine_for(on, low), names, options.cache, options.model)


def wraps(delegated, binding):
    """Whether a resolve.Binding keeps hmp's wrapper: all do but a delegated
    entry's own sites and spellings (one decided per call keeps its wrapper)."""
    if delegated is None or binding.kind is None or binding.picks:
        return True
    return binding.name not in delegated.names.get(binding.kind.name, ())


def changes(delegated, resolver, op_sites):
    """What the engine changes, ``(patches, hooks)`` as a rule's Changes: each
    op hmp wraps runs with autocast off (its wrapper's body pauses it), so do the
    other ops autocast acts on (patched here), a thread started while converted
    joins the engine, and so does the converting thread."""
    if delegated is None:
        return (), ()
    engine = delegated.engine
    wrapped = {(id(ns), attr) for ns, attr, _ in op_sites}
    left = autocast_reach.acted_on(engine.devices).difference(*delegated.names.values())
    patches = []
    for name in sorted(left):
        for site in resolver.sites(name) + _vf_site(name):
            key, original = (id(site.namespace), site.attr), site.original()
            if key in wrapped or isinstance(original, types.FunctionType):
                continue  # hmp's wrapper, or a Python function that reaches the builtin
            wrapped.add(key)
            patches.append((site.namespace, site.attr, off_around(original, engine.devices)))
    start = unwrap(threading.Thread.__dict__["_bootstrap_inner"])
    patches.append((threading.Thread, "_bootstrap_inner", joining(start, engine)))
    patches += _copies(delegated)
    return tuple(patches), (functools.partial(_Joined, delegated),)


def _vf_site(name):
    """torch._VF's builtin of ``name`` where torch's name for it is a Python function that calls
    it there (``torch.tensordot``, ``torch.cartesian_prod``): set on torch._VF, it shadows the
    lookup those functions make (revert deletes it again)."""
    python = getattr(torch, name, None)
    builtin = getattr(torch_private.VF, name, None)
    if not isinstance(unwrap(python), types.FunctionType) or not isinstance(builtin, types.BuiltinFunctionType):
        return []
    return [Site(torch_private.VF, name, torch_private.VF_LABEL, False)]


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

    def remove(self):
        self.engine.in_force, self.engine.delegated = False, {}
        if weight_cache.autocasts is self.engine:  # no copy of autocast's is kept past the conversion
            weight_cache.autocasts = None
        self.engine.seen = None
        torch.clear_autocast_cache()
        self.engine.depart(tls)
        self.engine.leave_main_thread()


def says(decided):
    """``effective_lists(detail=True)``'s entries under the engine in force: which engine casts each,
    and where an entry hmp leaves to torch is one autocast would act on, what it does there."""
    engine = in_force()
    if engine is None:
        return decided
    acted = autocast_reach.acted_on(engine.devices)
    out = {}
    for kind, entries in decided.items():
        ours = engine.delegated.get(kind, ())
        out[kind] = {n: _said(why, n in ours, n in acted) for n, why in entries.items()}
    return out


def _said(why, delegated, acted):
    if why == "cast":
        return DELEGATED if delegated else WRAPPED
    if delegated:
        return f"{why}; {ACTS}"
    return f"{why}; {OFF}" if acted else why
