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

from . import errors, interop, lists, pickling, policy, record, state, user, wrap
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
        self._log_restore = None


runtime = _Runtime()


def _given(path):
    return path is not None and not (isinstance(path, str) and path == "")


def _options(opt_level, isVerbose, low_precision_type, cache):
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"hmp: opt_level must be one of {', '.join(OPT_LEVELS)}, got {opt_level!r}")
    if low_precision_type not in LOW_DTYPES:
        raise ValueError(f"hmp: low_precision_type must be torch.bfloat16 or torch.float16, got {low_precision_type!r}")
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


def effective_lists_for(opt_level="O1", bf16_file_path="", fp32_file_path="", promote_file_path="",
                        resolver=None, environ=None):
    """Read, validate and combine the lists; raises before anything changes.

    Precedence for each list: the explicit argument, then the environment
    variables in ENV_LISTS, then the shipped default.
    """
    resolver = resolver or Resolver()
    environ = os.environ if environ is None else environ
    paths = {"bf16": bf16_file_path, "fp32": fp32_file_path, "promote": promote_file_path}
    titles = dict(TITLES)
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
    return unwrap(site.namespace.__dict__[site.attr])


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
            low_precision_type=torch.bfloat16, *, promote_file_path="", cache=True):
    """Patch torch so listed ops run in the dtypes their lists say.

    ``""`` or ``None`` for a path means the list named by the environment
    (``LOWER_LIST``/``FP32_LIST``, then ``PT_HPU_AUTOCAST_*``), else the
    default. Calling it again re-configures; it never wraps a wrapper. Raises
    before patching anything. ``cache=False`` turns off the weight-cast cache
    (see hmp/cache.py).
    """
    with runtime.lock:
        _options(opt_level, isVerbose, low_precision_type, cache)
        resolver = Resolver()
        effective = effective_lists_for(opt_level, bf16_file_path, fp32_file_path, promote_file_path, resolver)
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
        for owner, name, _ in user.registered:
            if not callable(getattr(owner, name, None)):
                raise ValueError(f"hmp: registered {user.owner_label(owner)}.{name} is gone")
        _revert_locked()
        try:
            for site, make in plan:
                rt.patches.setattr(site.namespace, site.attr, make(_original(site)))
            rt.policies = policies
            for entry in list(user.registered):
                apply_registration(entry)
            pickling.install(rt.patches)
        except BaseException:
            rt.patches.undo()
            rt.policies = None
            raise
        user.active = policies.user_prepares()
        errors.install_hooks()
        rt.lists = {k: sorted(v) for k, v in effective.items()}
        rt.options = dict(options)
        if cache:
            state.on_reenable = weight_cache.clear
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
        rt.patches.undo()
    finally:
        left = {id(v) for v in rt.patches.values()}  # entries that could not be undone stay live
        for value in installed:
            if id(value) not in left:
                wrap.retire(value)
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
