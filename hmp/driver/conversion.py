"""convert() and revert(): the pipeline, and the only writer of ``state.runtime``
(the conversion in force; threads' cast state goes through ``state.enter``/``leave``).

convert() validates its options, loads the lists (lists.py), resolves their names to the sites they bind
(resolve.py), builds each site's wrapper with the policy its list gives it (wrap.py, policy.py) and only then
patches, through the undo log (patch.py): a failed convert() leaves torch as it was.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator, NamedTuple

import torch

from hmp import rules, tested
from hmp.binding import engine as engine_plan
from hmp.binding import imports, lists, module_entries, modules, pays, sites, wrapper_life
from hmp.binding.aten import returns_view
from hmp.binding.kinds import FP32, LOWER
from hmp.binding.resolve import Binding, Resolver, attribute_site, owner_label
from hmp.core import cache, dtypes, rescue
from hmp.core.cache import clear_cache
from hmp.core.cast_copies import FINITE_CASTS
from hmp.core.hints import ListPath, ModuleTargets
from hmp.core.identity import unwrap
from hmp.core.state import close_block, first_time, runtime, user_stacklevel
from hmp.diagnostics import errors, interop
from hmp.driver.patch import MISSING, PatchLog
from hmp.driver.plan import Requested, options_of, plan
from hmp.driver.queries import effective_lists, in_force
from hmp.rules import pickling, regions, steps

log = logging.getLogger("hmp")
# every entry point convert() patched, one line each: isVerbose=True says how many; set this logger to
# DEBUG for the list (hundreds of lines)
patch_logger = logging.getLogger("hmp.patches")
patch_logger.setLevel(logging.INFO)


@options_of
def convert(
    opt_level: str = "O1",
    bf16_file_path: ListPath = "",
    fp32_file_path: ListPath = "",
    isVerbose: bool = False,
    low_precision_type: torch.dtype = torch.bfloat16,
    *,
    promote_file_path: ListPath = "",
    cache: bool = True,
    fp16_file_path: ListPath = "",
    fp32_modules: ModuleTargets = None,
    bf16_modules: ModuleTargets = None,
    model: torch.nn.Module | None = None,
    uncast_file_path: ListPath = "",
    strict: bool | None = None,
    engine: str | None = None,
) -> None:
    """Patch torch so listed ops run in the dtypes their lists say.

    ``""`` or ``None`` for a path means the list named by the environment
    (``LOWER_LIST``/``FP32_LIST``, then ``PT_HPU_AUTOCAST_*``), else the
    default. Calling it again re-configures; it never wraps a wrapper. Raises
    before patching anything. ``cache=False`` turns off the weight-cast cache
    (see hmp/core/cache.py). ``fp16_file_path`` has the meaning of Habana's HMP:
    the lower-precision list when ``low_precision_type=torch.float16``
    (ignored, with a warning, under bfloat16). ``fp32_modules`` /
    ``bf16_modules``: module classes, instances, or names matched against
    ``model.named_modules()`` (``"lm_head"``, ``"*.post_attention_layernorm"``)
    whose whole forward runs under that list's rule (hmp/binding/modules.py), as
    module entries of the list files do. ``uncast_file_path``: the entry
    points that run with casts off (hmp/rules/uncast_calls.py); ``""`` is the
    shipped list. ``strict=True`` (``None``: ``HMP_STRICT=1`` in the
    environment) is Habana's literal rule: every op in the lower-precision list
    casts float32 down, pointwise ops, normalisations and dropout too, as on
    HPU, and warns once with what that risks (docs/never-changes.md); by
    default only the entries that gain from the lower dtype (matrix products,
    convolutions, RNNs) cast, and every other op follows torch's type
    promotion (hmp/binding/pays.py; ``effective_lists(detail=True)`` says per entry). ``engine="autocast"``:
    torch.autocast casts the ops where it agrees with the lists, hmp's wrappers the rest (docs/engines.md).
    """
    options = Requested(
        opt_level=opt_level,
        bf16_file_path=bf16_file_path,
        fp32_file_path=fp32_file_path,
        isVerbose=isVerbose,
        low_precision_type=low_precision_type,
        promote_file_path=promote_file_path,
        cache=cache,
        fp16_file_path=fp16_file_path,
        fp32_modules=fp32_modules,
        bf16_modules=bf16_modules,
        model=model,
        uncast_file_path=uncast_file_path,
        strict=strict,
        engine=engine,
    )
    with runtime.lock:
        resolver = Resolver()  # one for checking the lists and binding them: names resolve once
        install(plan(options, resolver), resolver)


def install(wanted, resolver=None):
    """What convert() does with a checked plan (and the Lightning plugin with its own): say once
    what the program should know (inside autocast, a newer torch, strict's risks), then apply it."""
    with runtime.lock:
        interop.warn_inside_autocast()  # before patching: a warnings filter set to "error" patches nothing
        tested.warn_if_newer()
        tested.warn_if_lacking()
        if wanted.options.strict:
            _warn_strict()
        apply(wanted, resolver)


def _warn_strict():
    if first_time(("strict",)):
        warnings.warn(
            "hmp: strict=True (or HMP_STRICT=1) is Habana's literal rule: every listed op casts its float32 "
            "inputs down, pointwise ops, normalisations and dropout too. Float32 state updated through them "
            "outside optimizer.step() is then computed in bfloat16 and may stall or drift: an EMA "
            "(ema = d * ema + (1 - d) * p), AveragedModel, a soft target update (t.copy_(tau * p + (1 - tau) * t)), "
            "running sums. Keep such updates inside `with hmp.disable_casts():`, or leave strict off "
            "(docs/never-changes.md). hmp warns about this once per process.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


@contextlib.contextmanager
def converted(*args: Any, **kwargs: Any) -> Iterator[None]:
    """``convert(*args, **kwargs)`` for a block; on exit, also when the block
    raises, the configuration in force before it is back (none: reverted).

    A conversion is process-wide, so blocks in several threads form one
    stack: the newest open block's configuration is in force, and once
    every block has exited, the one before the first is back. A block that
    exits while a newer one is open (thread A's block ends inside B's)
    changes nothing then; the newer block, on its exit, restores what the
    older one found.
    """
    with runtime.lock:
        entry = [in_force()]  # what this block restores; a list: an older block's exit may hand it its own
        convert(*args, **kwargs)
        runtime.blocks.append(entry)
    try:
        yield
    finally:
        with runtime.lock:
            _leave_block(entry)


def _leave_block(entry):
    # not on the stack (cannot happen through converted()): restore as asked
    if close_block(runtime.blocks, entry) is not False:
        restore(entry[0])


def _registration(wrappers, owner, name, kind):
    if not callable(getattr(owner, name, None)):
        raise ValueError(f"hmp: registered {owner_label(owner)}.{name} is gone")
    original = unwrap(getattr(owner, name))
    return owner, name, wrappers.site(Binding(attribute_site(owner, name), kind, name), original)


def apply(conversion, resolver=None, recorder=None, passthrough=False):
    """Install ``conversion`` (a Conversion with checked lists) in place of
    the current one. profile/audit/tune pass a ``recorder`` (hmp/tools/record.py)
    and ``passthrough``."""
    # the wrappers' error path (hmp/core/rescue.py) adds errors' note: core knows nothing of that floor
    rescue.on_error(errors.annotate)
    # once per process, outside the lock: an import that may run a watched module's callback
    if not runtime.ready_for_compile:
        wrapper_life.ready_for_compile()
        runtime.ready_for_compile = True
    with runtime.lock:
        _install_built(conversion, _build(conversion, resolver or Resolver(), recorder, passthrough))


class _Built(NamedTuple):
    """Everything a conversion changes, made without changing anything (``_build``)."""

    op_sites: list  # (namespace, attr, wrapper)
    patches: list  # (namespace, attr, value): module entries' and the rules'
    changes: list  # each rule's Changes (their hooks are registered once the patches are in)
    forwards: object  # modules.Forwards, or None under passthrough
    watch: object  # imports.Watch: entries whose module the program imports later
    wrappers: object  # sites.Wrappers
    user: dict  # @hmp.*_function wrapper -> its prepare under this conversion


def _build(conversion, resolver, recorder, passthrough):
    effective, options, by_module, uncast = conversion.lists, conversion.options, conversion.modules, conversion.uncast
    casters = cache.cached_casts() if options.cache else dict(FINITE_CASTS)
    watch = imports.Watch()
    wrappers = sites.Wrappers(
        options.low_precision_type, casters, options.isVerbose, recorder, passthrough, options.strict
    )
    # an op returning a view of its input is never wrapped (see aten.returns_view); ops in no list
    # that have no kernel for the lower dtype or need one dtype run as they would without hmp's casts
    fallback = lists.fallback_names(options.low_precision_type)
    placed = _placed()
    # entries that gain nothing from their list's rule are not bound: torch runs them (hmp/binding/pays.py)
    one_dtype = lists.one_dtype_names()
    bound = {k: {n for n in v if pays.decision(k, n, options.strict, one_dtype)[0]} for k, v in effective.items()}
    delegating = engine_plan.decide(options, bound, effective, resolver)  # engine="autocast": what autocast casts
    op_sites = [
        (b.site.namespace, b.site.attr, wrappers.site(b, _original(b.site, placed)))
        for b in resolver.bind(bound, fallback)
        if not returns_view(b.name) and engine_plan.wraps(delegating, b)
    ]
    op_sites += [_registration(wrappers, *entry) for entry in runtime.registered]
    patches, forwards = [], None
    if not passthrough:  # passthrough casts nothing: no module rules, and RNNs' own dtype check stays
        no_kernel = dict(fallback).get(FP32, ())
        fp32_names = set(effective[FP32]).union(n for n in no_kernel if not _listed(n, effective))
        forwards = modules.Forwards(options.low_precision_type, casters, fp32_names)
        patches += modules.patches(by_module, forwards)
        modules.on_import(by_module, watch, forwards, _later)
    ctx = rules.Context(effective, uncast, watch, not passthrough, bool(by_module.get(LOWER)), _later, _again)
    delegated = rules.Changes(*engine_plan.changes(delegating, resolver, op_sites))  # engine="autocast": its changes
    changes = [rule.changes(ctx) for rule in rules.RULES] + [delegated]
    _say_lacks(changes)
    for change in changes:
        patches += change.patches
    user = {w: wrappers.user_prepare(kind, w.__qualname__) for w, kind in list(runtime.decorated.items())}
    return _Built(op_sites, patches, changes, forwards, watch, wrappers, user)


def _install_built(conversion, built):
    """Put ``built`` in place of the conversion in force, through the undo log;
    on any failure, nothing of it stays."""
    _revert_locked()
    undo_log = runtime.undo_log = runtime.undo_log or PatchLog()
    try:
        for namespace, attr, value in built.op_sites:
            _install(undo_log, namespace, attr, value)
        for namespace, attr, value in built.patches:
            # an instance entry's forward: another library may wrap it while converted (accelerate's
            # hooks); revert() then leaves theirs, and the entry it holds runs the original
            undo_log.setattr(namespace, attr, value, if_unchanged=isinstance(namespace, torch.nn.Module))
        runtime.forwards = built.forwards
        runtime.pickle_names = pickling.names(undo_log.records())
        runtime.handles = []  # filled one by one: revert() removes those registered before a failure
        for change in built.changes:
            for register_hook in change.hooks:
                runtime.handles.append(register_hook())
        if built.watch.patterns:
            runtime.handles.append(built.watch.hook())
    except BaseException:
        _revert_locked()
        raise
    for w, prepare in built.user.items():
        wrapper_life.resume(w, prepare)
    options = conversion.options
    runtime.conversion = conversion._replace(lists={k: frozenset(v) for k, v in conversion.lists.items()})
    runtime.wrappers = built.wrappers
    if options.isVerbose:
        _log_conversion(undo_log)


def _later(namespace, attr, value):
    """A change a rule or module entry makes after convert() returned (a
    module imported, a class created): through the conversion's undo log, the
    one writer of it, unless the conversion is gone meanwhile (then False)."""
    with runtime.lock:
        if runtime.conversion is None or runtime.undo_log is None:
            return False
        runtime.undo_log.setattr(namespace, attr, value)
        return True


def _again(fn):
    """``fn`` run under the conversion in force now, wherever and whenever it
    runs: when another (or none) is in force then, this one is installed for
    its call and the one in force put back after (rules/checkpoint.py)."""
    saved = runtime.conversion

    def run(*args, **kwargs):
        if runtime.conversion is saved or saved is None:
            return fn(*args, **kwargs)
        with applied(saved):
            return fn(*args, **kwargs)

    return run


def _say_lacks(changes):
    for change in changes:
        for line in change.lacks:  # a torch newer than the tested ones: what is not kept, once per process
            if first_time(("torch lacks", line)):
                warnings.warn(f"{line} (hmp warns about this once per process.)", RuntimeWarning, stacklevel=4)


def _placed():
    """``(id(namespace), attr) -> wrapper`` hmp put at an op site, which another
    library may hold now: the current conversion's, and those displaced earlier."""
    records = runtime.undo_log.records() if runtime.undo_log is not None else []
    placed = {(id(e.namespace), e.attr): e.value for e in records if wrapper_life.is_wrapper(e.value)}
    placed.update((key, e.value) for key, e in runtime.displaced.items())
    return placed


def _original(site, placed):
    wrapper = placed.get((id(site.namespace), site.attr))
    return unwrap(wrapper) if wrapper is not None else site.original()


def _install(undo_log, namespace, attr, value):
    """Put an op's wrapper at its site; where another library replaced hmp's
    wrapper there (wrapped it, or saved it to put back later), the site stays
    theirs and the wrapper they hold does what ``value`` would."""
    displaced = runtime.displaced.get((id(namespace), attr))
    if displaced is not None and namespace.__dict__.get(attr, MISSING) not in (displaced.value, displaced.previous):
        wrapper_life.take_over(displaced.value, value)
        runtime.adopted.append(displaced)
        return
    undo_log.setattr(namespace, attr, value, if_unchanged=True)


def _settle_displaced(rt, left):
    """After an undo: remember op sites another library took over (``left``),
    retire the wrappers they hold, and restore those whose wrapper came back."""
    for record in left:
        if wrapper_life.is_wrapper(record.value):
            rt.displaced[(id(record.namespace), record.attr)] = record
    for record in rt.adopted:
        wrapper_life.retire(record.value)
    rt.adopted = []
    for key, record in list(rt.displaced.items()):
        now = record.namespace.__dict__.get(record.attr, MISSING)
        if now is record.value:  # hmp's wrapper put back: undo it now
            if record.previous is MISSING:
                delattr(record.namespace, record.attr)
            else:
                setattr(record.namespace, record.attr, record.previous)
        if now is record.value or now is record.previous:  # torch's own is there: the site is free again
            del rt.displaced[key]


def _listed(name, effective):
    return any(name in names for names in effective.values())


def _log_conversion(undo_log):
    runtime.log_restore = _start_verbose_logging()
    options = runtime.conversion.options
    log.info("hmp: convert opt_level=%s, lower dtype %s", options.opt_level, dtypes.name(options.low_precision_type))
    for kind, entries in effective_lists(detail=True).items():
        cast = [n for n, why in entries.items() if why == pays.CAST]
        log.info("hmp: %s list, cast: %s", kind, ", ".join(cast) or "(none)")
        by_why = {}
        for name, why in entries.items():
            if why != pays.CAST and not why.startswith("module entry"):
                by_why.setdefault(why, []).append(name)
        for why, names in by_why.items():
            log.info("hmp: %s list, %s: %s", kind, why, ", ".join(names))
    for kind, entries in runtime.conversion.modules.items():
        if entries:
            log.info("hmp: %s modules: %s", kind.name, ", ".join(module_entries.shown(e) for e in entries))
    labels = undo_log.labels()
    log.info(
        "hmp: patched %d entry points (each one: logging.getLogger('hmp.patches').setLevel(logging.DEBUG))",
        len(labels),
    )
    for label in labels:
        patch_logger.debug("hmp: patched %s", label)


def _start_verbose_logging():
    previous_level = log.level
    handler = None
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.DEBUG)

    def restore():
        log.setLevel(previous_level)
        if handler is not None:
            log.removeHandler(handler)

    return restore


def _revert_locked():
    rt = runtime
    for w in list(rt.decorated):
        wrapper_life.pause(w)
    for handle in rt.handles:
        handle.remove()
    rt.handles = []
    if rt.forwards is not None:
        rt.forwards.in_force = False  # module entries another library still holds run their originals
        rt.forwards = None
    undo_log = rt.undo_log
    installed = undo_log.values() if undo_log is not None else []
    left = []
    try:
        if undo_log is not None:
            left = undo_log.undo()
    finally:
        _settle_displaced(rt, left)
        left = {id(v) for v in undo_log.values()} if undo_log is not None else set()
        for value in installed:  # entries that could not be undone stay live
            if id(value) not in left:
                wrapper_life.retire(value)
        regions.forget_open_regions()
        steps.forget_open_steps()
        clear_cache()
        rt.pickle_names = {}
        rt.conversion = None
        rt.wrappers = None
        if rt.log_restore is not None:
            rt.log_restore()
            rt.log_restore = None


def revert() -> None:
    """Undo convert() completely; a no-op when not converted."""
    with runtime.lock:
        _revert_locked()


def restore(saved):
    """Put back what in_force() returned: that conversion, or none."""
    if saved is None:
        revert()
    else:
        apply(saved)


@contextlib.contextmanager
def applied(conversion, recorder=None, passthrough=False):
    """``conversion`` installed for a block (None: plain torch); the one in
    force before is back on exit."""
    with runtime.lock:
        saved = in_force()
        if conversion is None:
            revert()
        else:
            apply(conversion, recorder=recorder, passthrough=passthrough)
    try:
        yield
    finally:
        restore(saved)


def register(owner, name, kind):
    """Record ``hmp.register(owner, name, kind)``; wrap it now if converted."""
    with runtime.lock:
        unregister(owner, name)
        runtime.registered.append((owner, name, kind))
        if runtime.conversion is not None:
            _later(*_registration(runtime.wrappers, owner, name, kind))


def unregister(owner, name):
    with runtime.lock:
        runtime.registered[:] = [e for e in runtime.registered if not (e[0] is owner and e[1] == name)]


def track_decorated(wrapper, kind):
    """Take a ``@hmp.*_function`` wrapper (sites.user_function) into every
    conversion: resumed while converted, paused otherwise."""
    with runtime.lock:
        runtime.decorated[wrapper] = kind
        if runtime.wrappers is not None:
            wrapper_life.resume(wrapper, runtime.wrappers.user_prepare(kind, wrapper.__qualname__))
