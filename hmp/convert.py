"""convert() and revert(): one runtime object owns the configuration and
the patch log, and every change goes through that log.

convert() does all of its validation (files, names, options) and builds
every wrapper before it touches a namespace, so a failed convert() leaves
torch exactly as it was.
"""

import inspect
import logging
import os
import threading
import warnings

import torch

from . import checkpoint, errors, interop, lists, pickling, policy, record, regions, rnn, state, steps, user, wrap
from .cache import cache as weight_cache
from .patch import PatchLog
from .resolve import FUSED, Resolver, Site, unwrap

log = logging.getLogger("hmp")

LOW_DTYPES = (torch.bfloat16, torch.float16)
OPT_LEVELS = ("O1", "O2")
DEFAULT_FILES = {
    "O1": {"bf16": "bf16.txt", "fp32": "fp32.txt", "promote": "promote.txt"},
    "O2": {"bf16": "o2_bf16.txt", "fp32": "o2_fp32.txt", "promote": "promote.txt"},
}
TITLES = {"bf16": "BF16 list file", "fp32": "FP32 list file", "promote": "promote list file"}
FP16_TITLE = "FP16 list file"
# Environment variables naming list files when convert() gets no path, in
# order of precedence: the names Lightning's HPU docs use, then the names
# Habana's autocast reads.
ENV_LISTS = {
    "bf16": ("LOWER_LIST", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"),
    "fp32": ("FP32_LIST", "PT_HPU_AUTOCAST_FP32_OPS_LIST"),
}


class _Runtime:
    """The single owner of hmp's process-wide state."""

    def __init__(self):
        self.lock = threading.RLock()
        self.patches = PatchLog()
        self.lists = None  # {"bf16": [...], "fp32": [...], "promote": [...]} while converted
        self.options = None
        self.policies = None  # the _Policies of the current conversion
        self.steps = None  # the optimizer step hooks (hmp/steps.py) while converted
        self._log_restore = None


runtime = _Runtime()


def _given(path):
    return path is not None and not (isinstance(path, str) and path == "")


def _options(opt_level, isVerbose, low_precision_type, cache):
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"hmp: opt_level must be one of {', '.join(OPT_LEVELS)}, got {opt_level!r}")
    if low_precision_type not in LOW_DTYPES:
        raise ValueError(f"hmp: low_precision_type must be torch.bfloat16 or torch.float16, got {low_precision_type!r}")
    if isinstance(isVerbose, (str, os.PathLike)):
        raise TypeError(f"hmp: isVerbose must be a bool, got the path {isVerbose!r}: hmp's 4th positional parameter "
                        f"is isVerbose (Habana's later HMP put fp16_file_path there); pass fp16_file_path= by keyword")
    if not isinstance(isVerbose, bool):
        raise TypeError(f"hmp: isVerbose must be a bool, got {isVerbose!r}")
    if not isinstance(cache, bool):
        raise TypeError(f"hmp: cache must be a bool, got {cache!r}")


def _env_path(kind, environ):
    for var in ENV_LISTS.get(kind, ()):
        value = environ.get(var, "")
        if value:
            return value, var
    return "", None


def _low_list(bf16_file_path, fp16_file_path, low_precision_type):
    """``(path, title)`` of the lower-precision list, as Habana's HMP chose it:
    ``fp16_file_path`` is that list when the lower dtype is float16 and is
    ignored (with a warning) under bfloat16. hmp also lets bf16_file_path
    name it under float16 when no fp16_file_path is given."""
    if not _given(fp16_file_path):
        return bf16_file_path, TITLES["bf16"]
    if low_precision_type != torch.float16:
        warnings.warn(f"hmp: fp16_file_path {fp16_file_path!r} is ignored: it names the list for "
                      f"low_precision_type=torch.float16, and the lower dtype is {low_precision_type}",
                      stacklevel=lists.caller_level())
        return bf16_file_path, TITLES["bf16"]
    if _given(bf16_file_path):
        warnings.warn(f"hmp: bf16_file_path {bf16_file_path!r} is ignored: with low_precision_type=torch.float16 "
                      f"the lower-precision list is fp16_file_path {fp16_file_path!r}", stacklevel=lists.caller_level())
    return fp16_file_path, FP16_TITLE


def effective_lists_for(opt_level="O1", bf16_file_path="", fp32_file_path="", promote_file_path="",
                        resolver=None, environ=None, *, fp16_file_path="", low_precision_type=torch.bfloat16):
    """Read, validate and combine the lists; raises before anything changes.

    Precedence for each list: the explicit argument, then the environment
    variables in ENV_LISTS, then the shipped default. ``fp16_file_path``
    is the lower-precision list under ``low_precision_type=torch.float16``.
    """
    resolver = resolver or Resolver()
    environ = os.environ if environ is None else environ
    titles = dict(TITLES)
    bf16_file_path, titles["bf16"] = _low_list(bf16_file_path, fp16_file_path, low_precision_type)
    paths = {"bf16": bf16_file_path, "fp32": fp32_file_path, "promote": promote_file_path}
    for kind in ("bf16", "fp32"):
        if not _given(paths[kind]):
            paths[kind], var = _env_path(kind, environ)
            if var:
                titles[kind] = f"{TITLES[kind]} (from ${var})"
                log.info("hmp: %s list from $%s: %s", kind, var, paths[kind])
    if opt_level == "O2":
        ignored = [titles[k] for k in ("bf16", "fp32") if _given(paths[k])]
        if ignored:
            warnings.warn(f"hmp: opt_level O2 uses its own lists; ignoring the given {' and '.join(ignored)}",
                          stacklevel=3)
        paths["bf16"] = paths["fp32"] = ""
    from_user = {k: _given(p) for k, p in paths.items()}
    sources, names = {}, {}
    for kind in lists.KINDS:
        path = paths[kind] if from_user[kind] else lists.default_path(DEFAULT_FILES[opt_level][kind])
        sources[kind] = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
        names[kind] = lists.load(path, resolver, titles[kind])
    return lists.combine(names["bf16"], names["fp32"], names["promote"], from_user["bf16"], from_user["fp32"], sources)


class _Policies:
    """Every prepare function of one conversion, built once at convert time.

    ``recorder`` (hmp/record.py) instruments the wrappers for profiling;
    ``passthrough`` makes them cast nothing while still recording.
    """

    def __init__(self, low, casts, verbose, recorder=None, passthrough=False):
        self.verbose, self.recorder = verbose, recorder
        self.kind = {"bf16": policy.lower(low, casts), "fp32": policy.fp32(casts), "promote": policy.promote(casts)}
        self.norm = policy.lower_input_only(low, casts)
        self.out = policy.inplace_out(casts)
        self.into_input = policy.inplace_input(casts)
        self.into_self = policy.inplace_self(casts)
        if passthrough:
            for attr in ("norm", "out", "into_input", "into_self"):
                setattr(self, attr, record.passthrough)
            self.kind = dict.fromkeys(self.kind, record.passthrough)

    def _wrap_prepare(self, prepare, label, name):
        if self.verbose:
            prepare = wrap.logged(prepare, label)
        if self.recorder is not None:
            prepare = self.recorder.prepare(prepare, name)
        return prepare

    def maker(self, kind, name, site):
        """``make(original) -> wrapper`` for one site of op ``name`` in list ``kind``."""
        label, rec = site.label, self.recorder
        timed = (lambda op: op) if rec is None else rec.op
        about = errors.About(label, name, kind, site.inplace, site.inplace_param)  # for the error path
        if site.inplace:
            prepare = self._wrap_prepare(self.into_self, label, name)
            return lambda op: wrap.wrap_simple(timed(op), prepare, about)
        norm = kind == "bf16" and name in policy.NORM_OPS
        main = self.norm if norm else self.kind[kind]
        main, out, into = (self._wrap_prepare(p, label, name) for p in (main, self.out, self.into_input))
        if norm and name in policy.AFFINE_ONLY_NORMS:
            lower_all = self.kind["bf16"]
            return lambda op: wrap.wrap_call(timed(wrap.mixed_or_lower(op, lower_all)), main, out, into,
                                             site.inplace_param, about)
        return lambda op: wrap.wrap_call(timed(op), main, out, into, site.inplace_param, about)

    def user_prepares(self):
        return {kind: self._wrap_prepare(p, f"user {kind} function", f"user_{kind}_function")
                for kind, p in self.kind.items()}


def _plan(effective, policies, resolver):
    """[(site, make_wrapper(original) -> wrapper)] for every entry point."""
    plan, seen = [], set()
    # listed names first, so a fused kernel listed by name keeps its own list
    named = [(kind, name, resolver.sites(name)) for kind in lists.KINDS for name in sorted(effective[kind])]
    fused = [(kind, f, resolver.sites(f)) for kind, name, _ in named for f in FUSED.get(name, ())]
    for kind, name, sites in named + fused:
        for site in sites:
            key = (id(site.namespace), site.attr)
            if key not in seen:
                seen.add(key)
                plan.append((site, policies.maker(kind, name, site)))
    return plan


def _original(site):
    if isinstance(site.namespace, type):
        return unwrap(inspect.getattr_static(site.namespace, site.attr))
    own = site.namespace.__dict__
    # torch._VF serves its functions through __getattr__: none is its own attribute
    return unwrap(own[site.attr] if site.attr in own else getattr(site.namespace, site.attr))


def _registration_site(owner, name):
    fn = unwrap(getattr(owner, name))
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    return Site(owner, name, user.owner_label(owner), False, params.index("inplace") if "inplace" in params else None)


def apply_registration(entry):
    """Wrap one ``hmp.register()`` entry into the current conversion."""
    owner, name, kind = entry
    site = _registration_site(owner, name)
    wrapper = runtime.policies.maker(kind, name, site)(unwrap(getattr(owner, name)))
    runtime.patches.setattr(owner, name, wrapper)


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


def convert(opt_level="O1", bf16_file_path="", fp32_file_path="", isVerbose=False,
            low_precision_type=torch.bfloat16, *, promote_file_path="", cache=True, fp16_file_path=""):
    """Patch torch so listed ops run in the dtypes their lists say.

    ``""`` or ``None`` for a path means the list named by the environment
    (``LOWER_LIST``/``FP32_LIST``, then ``PT_HPU_AUTOCAST_*``), else the
    default. Calling it again re-configures; it never wraps a wrapper. Raises
    before patching anything. ``cache=False`` turns off the weight-cast cache
    (see hmp/cache.py). ``fp16_file_path`` has the meaning of Habana's HMP:
    the lower-precision list when ``low_precision_type=torch.float16``
    (ignored, with a warning, under bfloat16).
    """
    with runtime.lock:
        _options(opt_level, isVerbose, low_precision_type, cache)
        resolver = Resolver()
        effective = effective_lists_for(opt_level, bf16_file_path, fp32_file_path, promote_file_path, resolver,
                                        fp16_file_path=fp16_file_path, low_precision_type=low_precision_type)
        options = {"opt_level": opt_level, "low_precision_type": low_precision_type, "verbose": isVerbose,
                   "cache": cache}
        interop.warn_inside_autocast()  # before patching: a warnings filter set to "error" patches nothing
        install(effective, options, resolver=resolver)


def install(effective, options, resolver=None, recorder=None, passthrough=False):
    """Patch for already validated ``effective`` lists (a dict of name sets).

    convert() calls this; so do profile/audit/tune, which also pass a
    recorder. Everything that can fail happens before the first patch.
    """
    rt = runtime
    with rt.lock:
        resolver = resolver or Resolver()
        low, cache, verbose = options["low_precision_type"], options["cache"], options["verbose"]
        casts = weight_cache.casters() if cache else dict(policy.PLAIN_CASTS)
        policies = _Policies(low, casts, verbose, recorder, passthrough)
        plan = _plan(effective, policies, resolver)
        extra = checkpoint.patches()  # recomputes run under their forward's hmp state
        if not passthrough:  # passthrough casts nothing, so the module's own dtype check must stay
            extra += [p for p in [rnn.check_input_patch(effective)] if p is not None]
        extra += regions.plan()  # autocast regions, backward, GradScaler, DataLoader: left alone
        for owner, name, _ in user.registered:
            if not callable(getattr(owner, name, None)):
                raise ValueError(f"hmp: registered {user.owner_label(owner)}.{name} is gone")
        _revert_locked()
        try:
            for site, make in plan:
                rt.patches.setattr(site.namespace, site.attr, make(_original(site)))
            for namespace, attr, value in extra:
                rt.patches.setattr(namespace, attr, value)
            rt.policies = policies
            for entry in list(user.registered):
                apply_registration(entry)
            rt.steps = steps.StepHooks(rt.patches)
            pickling.install(rt.patches)
        except BaseException:
            rt.patches.undo()
            rt.policies = None
            raise
        user.active = policies.user_prepares()
        errors.install_hooks()
        rt.lists = {k: sorted(v) for k, v in effective.items()}
        rt.options = dict(options)
        if verbose:
            rt._log_restore = _start_verbose_logging()
            log.info("hmp: convert opt_level=%s, lower dtype %s", options["opt_level"], str(low).replace("torch.", ""))
            for kind in lists.KINDS:
                log.info("hmp: %s list: %s", kind, ", ".join(rt.lists[kind]))
            for label in rt.patches.labels():
                log.info("hmp: patched %s", label)


def _revert_locked():
    rt = runtime
    installed = rt.patches.values()
    try:
        if rt.steps is not None:
            rt.steps.remove()
            rt.steps = None
        rt.patches.undo()
    finally:
        left = {id(v) for v in rt.patches.values()}  # entries that could not be undone stay live
        for value in installed:
            if id(value) not in left:
                wrap.retire(value)
        regions.forget_open_regions()
        user.active = None
        pickling.clear()
        errors.remove_hooks()
        state.on_reenable = None
        weight_cache.clear()
        rt.lists = None
        rt.options = None
        rt.policies = None
        if rt._log_restore is not None:
            rt._log_restore()
            rt._log_restore = None


def revert():
    """Undo convert() completely; a no-op when not converted."""
    with runtime.lock:
        _revert_locked()


def is_converted():
    return runtime.lists is not None


def restore(saved):
    """Put back what current() returned: that conversion, or none."""
    if saved is None:
        revert()
    else:
        install(*saved)


def current():
    """``(effective lists, options)`` of the current conversion, or None; what
    install() takes to restore it."""
    with runtime.lock:
        if runtime.lists is None:
            return None
        return {k: set(v) for k, v in runtime.lists.items()}, dict(runtime.options)


def effective_lists():
    """``{"bf16", "fp32", "promote"}`` to sorted op names; empty when not converted."""
    current = runtime.lists
    if current is None:
        return {k: [] for k in lists.KINDS}
    return {k: list(v) for k, v in current.items()}
