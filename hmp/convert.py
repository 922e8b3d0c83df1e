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

from . import errors, interop, lists, policy, state, wrap
from .cache import cache as weight_cache
from .patch import PatchLog
from .resolve import FUSED, Resolver, unwrap

log = logging.getLogger("hmp")

LOW_DTYPES = (torch.bfloat16, torch.float16)
OPT_LEVELS = ("O1", "O2")
DEFAULT_FILES = {
    "O1": {"bf16": "bf16.txt", "fp32": "fp32.txt"},
    "O2": {"bf16": "o2_bf16.txt", "fp32": "o2_fp32.txt"},
}
TITLES = {"bf16": "BF16 list file", "fp32": "FP32 list file", "promote": "promote list file"}


class _Runtime:
    """The single owner of hmp's process-wide state."""

    def __init__(self):
        self.lock = threading.RLock()
        self.patches = PatchLog()
        self.lists = None  # {"bf16": [...], "fp32": [...], "promote": [...]} while converted
        self.options = None
        self._log_restore = None


runtime = _Runtime()


def _given(path):
    return path is not None and not (isinstance(path, str) and path == "")


def _options(opt_level, isVerbose, low_precision_type):
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"hmp: opt_level must be one of {', '.join(OPT_LEVELS)}, got {opt_level!r}")
    if low_precision_type not in LOW_DTYPES:
        raise ValueError(f"hmp: low_precision_type must be torch.bfloat16 or torch.float16, got {low_precision_type!r}")
    if not isinstance(isVerbose, bool):
        raise TypeError(f"hmp: isVerbose must be a bool, got {isVerbose!r}")


def effective_lists_for(opt_level="O1", bf16_file_path="", fp32_file_path="", promote_file_path="", resolver=None):
    """Read, validate and combine the lists; raises before anything changes."""
    resolver = resolver or Resolver()
    paths = {"bf16": bf16_file_path, "fp32": fp32_file_path, "promote": promote_file_path}
    if opt_level == "O2":
        ignored = [TITLES[k] for k in ("bf16", "fp32") if _given(paths[k])]
        if ignored:
            warnings.warn(f"hmp: opt_level O2 uses its own lists; ignoring the given {' and '.join(ignored)}", stacklevel=3)
        paths["bf16"] = paths["fp32"] = ""
    from_user = {k: _given(p) for k, p in paths.items()}
    defaults = dict(DEFAULT_FILES[opt_level], promote="promote.txt")
    sources, names = {}, {}
    for kind in lists.KINDS:
        path = paths[kind] if from_user[kind] else lists.default_path(defaults[kind])
        sources[kind] = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
        names[kind] = lists.load(path, resolver, TITLES[kind])
    return lists.combine(names["bf16"], names["fp32"], names["promote"], from_user["bf16"], from_user["fp32"], sources)


def _plan(effective, low, verbose, resolver, casts):
    """[(site, make_wrapper(original) -> wrapper)] for every entry point."""
    out = policy.inplace_out(casts)
    into_input = policy.inplace_input(casts)
    into_self = policy.inplace_self(casts)
    by_kind = {"bf16": policy.lower(low, casts), "fp32": policy.fp32(casts), "promote": policy.promote(casts)}
    norm = policy.lower_input_only(low, casts)
    plan, seen = [], set()
    # listed names first, so a fused kernel listed by name keeps its own list
    named = [(kind, name, resolver.sites(name)) for kind in lists.KINDS for name in sorted(effective[kind])]
    fused = [(kind, f, resolver.sites(f)) for kind, name, _ in named for f in FUSED.get(name, ())]
    for kind, name, sites in named + fused:
        for site in sites:
            key = (id(site.namespace), site.attr)
            if key in seen:
                continue
            seen.add(key)
            about = errors.About(site.label, name, kind, site.inplace, site.inplace_param)  # for the error path
            if site.inplace:
                make = _simple(_maybe_logged(into_self, site, verbose), about)
            else:
                prepare = norm if (kind == "bf16" and name in policy.NORM_OPS) else by_kind[kind]
                make = _call(
                    _maybe_logged(prepare, site, verbose),
                    _maybe_logged(out, site, verbose),
                    _maybe_logged(into_input, site, verbose),
                    site.inplace_param,
                    about,
                )
            plan.append((site, make))
    return plan


def _maybe_logged(prepare, site, verbose):
    return wrap.logged(prepare, site.label) if verbose else prepare


def _simple(prepare, about=None):
    return lambda op: wrap.wrap_simple(op, prepare, about)


def _call(prepare, prepare_out, prepare_inplace, inplace_param, about=None):
    return lambda op: wrap.wrap_call(op, prepare, prepare_out, prepare_inplace, inplace_param, about)


def _original(site):
    if isinstance(site.namespace, type):
        return unwrap(inspect.getattr_static(site.namespace, site.attr))
    return unwrap(site.namespace.__dict__[site.attr])


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

    ``""`` or ``None`` for a path means the default list. Calling it again
    re-configures; it never wraps a wrapper. Raises before patching anything.
    ``cache=False`` turns off the weight-cast cache (see hmp/cache.py).
    """
    rt = runtime
    with rt.lock:
        _options(opt_level, isVerbose, low_precision_type)
        if not isinstance(cache, bool):
            raise TypeError(f"hmp: cache must be a bool, got {cache!r}")
        resolver = Resolver()
        effective = effective_lists_for(opt_level, bf16_file_path, fp32_file_path, promote_file_path, resolver)
        casts = weight_cache.casters() if cache else dict(policy.PLAIN_CASTS)
        plan = _plan(effective, low_precision_type, isVerbose, resolver, casts)
        interop.warn_inside_autocast()  # before patching: a warnings filter set to "error" patches nothing
        _revert_locked()
        try:
            for site, make in plan:
                rt.patches.setattr(site.namespace, site.attr, make(_original(site)))
        except BaseException:
            rt.patches.undo()
            raise
        errors.install_hooks()
        rt.lists = {k: sorted(v) for k, v in effective.items()}
        rt.options = {"opt_level": opt_level, "low_precision_type": low_precision_type, "verbose": isVerbose,
                      "cache": cache}
        if cache:
            state.on_reenable = weight_cache.clear
        if isVerbose:
            rt._log_restore = _start_verbose_logging()
            low = str(low_precision_type).replace("torch.", "")
            log.info("hmp: convert opt_level=%s, lower dtype %s", opt_level, low)
            for kind in lists.KINDS:
                log.info("hmp: %s list: %s", kind, ", ".join(rt.lists[kind]))
            for label in rt.patches.labels():
                log.info("hmp: patched %s", label)


def _revert_locked():
    rt = runtime
    try:
        rt.patches.undo()
    finally:
        errors.remove_hooks()
        state.on_reenable = None
        weight_cache.clear()
        rt.lists = None
        rt.options = None
        if rt._log_restore is not None:
            rt._log_restore()
            rt._log_restore = None


def revert():
    """Undo convert() completely; a no-op when not converted."""
    with runtime.lock:
        _revert_locked()


def is_converted():
    return runtime.lists is not None


def effective_lists():
    """``{"bf16", "fp32", "promote"}`` to sorted op names; empty when not converted."""
    current = runtime.lists
    if current is None:
        return {k: [] for k in lists.KINDS}
    return {k: list(v) for k, v in current.items()}
