"""What a convert() call asks for, checked before anything changes: its
options and the Conversion (lists, module entries, uncast calls) that
hmp/driver/conversion.py installs."""

import inspect
import os
import warnings
import weakref
from typing import NamedTuple

import torch

from hmp.binding import engine as engine_plan
from hmp.binding import kinds, lists, module_entries, uncast_list
from hmp.binding.resolve import Resolver
from hmp.core.dtypes import LOW
from hmp.core.hints import ListPath, ModuleTargets
from hmp.core.state import first_time, user_stacklevel


class Requested(NamedTuple):
    """What a convert() call asks for, as given, by convert()'s parameter names: convert() builds
    it from its named parameters and plan() takes it (tests/unit/driver/test_conversion.py checks that
    these defaults are convert()'s)."""

    opt_level: str = "O1"
    bf16_file_path: ListPath = ""
    fp32_file_path: ListPath = ""
    isVerbose: bool = False
    low_precision_type: torch.dtype = torch.bfloat16
    promote_file_path: ListPath = ""
    cache: bool = True
    fp16_file_path: ListPath = ""
    fp32_modules: ModuleTargets = None
    bf16_modules: ModuleTargets = None
    model: torch.nn.Module | None = None
    uncast_file_path: ListPath = ""
    strict: bool | None = None
    engine: str | None = None


class Options(NamedTuple):
    """convert()'s options that are not files or module entries, checked, by
    convert()'s names (its signature holds their one set of defaults)."""

    opt_level: str
    low_precision_type: torch.dtype  # the lower-precision dtype
    isVerbose: bool
    cache: bool  # the weight-cast cache (hmp/core/cache.py)
    strict: bool  # Habana's literal rule: every listed op casts, pointwise ones too (None given: HMP_STRICT)
    engine: str = "python"  # who casts: hmp's wrappers, or torch.autocast where the lists agree (docs/engines.md)
    model: object = None  # a weak reference to convert(model=...)'s model: engine="autocast" checks its weights


class Conversion(NamedTuple):
    """What one convert() installed; ``apply()`` installs it again."""

    lists: dict  # list kind (kinds.Kind) -> set of op names
    options: Options
    modules: dict  # list kind -> module classes and instances (hmp/binding/modules.py), for kinds that take them
    uncast: tuple = ()  # uncast_list.Entry: code that runs with casts off (building, averaging, merging)
    # the kinds whose list a user's file (or names) gave whole, without 'include default': what tune's files
    # keep whole too, so a list that replaced the default still does when nothing changes
    replacing: frozenset = frozenset()


def _looks_like_path(text):
    """A string a Habana-era caller meant as fp16_file_path (a separator, a
    file suffix, or a file that exists), not a word like "yes"."""
    text = os.fsdecode(text)
    return os.sep in text or "/" in text or os.path.splitext(text)[1] != "" or os.path.exists(text)


STRICT_ENV = "HMP_STRICT"  # strict=None reads it: HMP_STRICT=1 runs an unchanged script under Habana's rule


def _strict(strict):
    if strict is None:
        value = os.environ.get(STRICT_ENV, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"hmp: {STRICT_ENV} must be 0 or 1, got {value!r}")
        return value == "1"
    if not isinstance(strict, bool):
        raise TypeError(f"hmp: strict must be a bool (or None: {STRICT_ENV} decides), got {strict!r}")
    return strict


ENGINE_ENV = "HMP_ENGINE"  # engine=None reads it: HMP_ENGINE=autocast tries the engine on an unchanged script


def _autocast_refused(low):
    """Why engine="autocast" cannot run this conversion, or None."""
    if low != torch.bfloat16:
        return "engine='autocast' runs bfloat16 only; float16 keeps engine='python' (docs/engines.md)"
    hpu = getattr(torch, "hpu", None)
    if hpu is not None and hpu.is_available():
        return "engine='autocast' programs CPU and CUDA autocast; on HPU use engine='python'"
    return None


def _engine(engine, low):
    name = "engine"
    if engine is None:
        engine, name = os.environ.get(ENGINE_ENV, "").strip() or "python", ENGINE_ENV
    if engine not in engine_plan.ENGINES:
        raise ValueError(f"hmp: {name} must be one of {', '.join(engine_plan.ENGINES)}, got {engine!r}")
    refused = _autocast_refused(low) if engine == "autocast" else None
    if refused is None:
        return engine
    if name == "engine":
        raise ValueError(f"hmp: {refused}")
    # the environment asks for the engine where it runs: an unchanged float16 (or HPU) script keeps working
    if first_time(("engine from the environment", low)):
        warnings.warn(
            f"hmp: {ENGINE_ENV}=autocast runs bfloat16 on CPU and CUDA only; this conversion "
            f"({low}) keeps engine='python' (docs/engines.md). (hmp warns once.)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return "python"


def check_options(opt_level, isVerbose, low_precision_type, cache, strict, engine=None):
    if isinstance(opt_level, torch.nn.Module):
        raise TypeError(
            f"hmp: convert() takes no model: it patches torch's ops process-wide, so every model runs under "
            f"the lists once it is called; call hmp.convert() and run {type(opt_level).__name__} as it is "
            f"(model= is only for naming modules in fp32_modules/bf16_modules)"
        )
    if opt_level not in kinds.OPT_LEVELS:
        raise ValueError(f"hmp: opt_level must be one of {', '.join(kinds.OPT_LEVELS)}, got {opt_level!r}")
    if low_precision_type not in LOW:
        raise ValueError(f"hmp: low_precision_type must be torch.bfloat16 or torch.float16, got {low_precision_type!r}")
    if isinstance(isVerbose, (str, bytes)) and not _looks_like_path(isVerbose):
        raise TypeError(f"hmp: isVerbose must be a bool (True or False), got the string {isVerbose!r}")
    if isinstance(isVerbose, (str, bytes)) or hasattr(isVerbose, "__fspath__"):
        raise TypeError(
            f"hmp: isVerbose must be a bool, got the path {isVerbose!r}: hmp's 4th positional parameter "
            f"is isVerbose (Habana's later HMP put fp16_file_path there); pass fp16_file_path= by keyword"
        )
    if not isinstance(isVerbose, bool):
        raise TypeError(f"hmp: isVerbose must be a bool, got {isVerbose!r}")
    if not isinstance(cache, bool):
        raise TypeError(f"hmp: cache must be a bool, got {cache!r}")
    return Options(
        opt_level, low_precision_type, isVerbose, cache, _strict(strict), _engine(engine, low_precision_type)
    )


def plan(options, resolver=None):
    """The Conversion convert() would install, checked; changes nothing. ``options``: a Requested
    (``requested`` binds a call's arguments to one)."""
    low = options.low_precision_type
    checked = check_options(options.opt_level, options.isVerbose, low, options.cache, options.strict, options.engine)
    if isinstance(options.model, torch.nn.Module):
        checked = checked._replace(model=weakref.ref(options.model))
    replacing = set()
    effective, classes = lists.effective(
        resolver or Resolver(),
        options.opt_level,
        {k: getattr(options, k.parameter, "") for k in kinds.KINDS},  # a kind convert() takes no file for: its default
        fp16=options.fp16_file_path,
        low=low,
        strict=checked.strict,
        replacing=replacing,
    )
    given_entries = {}
    for k in kinds.KINDS:
        if k.takes_modules:
            given = getattr(options, k.modules_parameter, None)
            given_entries[k] = module_entries.from_parameter(given, options.model, k.modules_parameter)
    uncast = uncast_list.load(options.uncast_file_path)
    return Conversion(effective, checked, module_entries.merge(classes, given_entries), uncast, frozenset(replacing))


# kept: convert()'s signature, read once
PARAMETERS = {}  # convert()'s parameters by name (inspect.Parameter), read from its signature (options_of)


def options_of(convert):
    """Take ``convert``'s parameters as the options a conversion has, once:
    plan() and every integration read them here, so an option added to
    convert() reaches them all."""
    PARAMETERS.update(inspect.signature(convert).parameters)
    return convert


def requested(*args, **kwargs):
    """convert()'s options, by name, for a call ``convert(*args, **kwargs)``; a
    TypeError, as convert's own, for an argument it does not take."""
    return dict(inspect.Signature(list(PARAMETERS.values())).bind(*args, **kwargs).arguments)
