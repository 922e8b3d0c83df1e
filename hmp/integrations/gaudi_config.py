"""optimum-habana's ``gaudi_config.json``, applied with hmp.

optimum-habana configures mixed precision with a small JSON file::

    {
      "use_habana_mixed_precision": true,
      "hmp_opt_level": "O1",
      "hmp_is_verbose": false,
      "hmp_bf16_ops": ["add", "addmm", "bmm", ...],
      "hmp_fp32_ops": ["embedding", "nll_loss", "log_softmax"],
      "use_fused_adam": true
    }

or, in later releases, ``"use_torch_autocast": true`` with
``autocast_bf16_ops`` / ``autocast_fp32_ops``. :func:`convert_from_config`
maps both forms onto :func:`hmp.convert`. The lists in the config are op
names (not files); they are checked here first, so an error names the field
and the position (``hmp_bf16_ops[3]: unknown op 'sofmax'; did you mean
softmax?``), and nothing changes when the config is wrong.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from hmp.binding import kinds, list_files, lists, module_entries
from hmp.binding.kinds import FP32, LOWER, OPT_LEVELS
from hmp.binding.lists import Names
from hmp.binding.resolve import NO_PYTHON, UNKNOWN, Resolver
from hmp.driver.conversion import convert, revert
from hmp.driver.plan import PARAMETERS

log = logging.getLogger("hmp")

# field -> what it holds
BOOL_FIELDS = ("use_habana_mixed_precision", "use_torch_autocast", "hmp_is_verbose")
LIST_FIELDS = ("hmp_bf16_ops", "hmp_fp32_ops", "autocast_bf16_ops", "autocast_fp32_ops")
STR_FIELDS = ("hmp_opt_level",)
# hmp's own: module classes (import paths) or module name patterns, in either mode
MODULE_FIELDS = {k.name: f"hmp_{k.modules_parameter}" for k in kinds.KINDS if k.takes_modules}
FIELDS = BOOL_FIELDS + LIST_FIELDS + STR_FIELDS + tuple(MODULE_FIELDS.values())

# which list fields each mode reads: (bf16 field, fp32 field)
MODE_LISTS = {
    "use_habana_mixed_precision": ("hmp_bf16_ops", "hmp_fp32_ops"),
    "use_torch_autocast": ("autocast_bf16_ops", "autocast_fp32_ops"),
}


# optimum-habana's GaudiConfig fills a missing hmp_bf16_ops / hmp_fp32_ops
# with the lists of its BERT config; hmp ships that config and reads them
# from it, so the defaults and the example cannot drift apart.
HMP_DEFAULTS_FILE = "gaudi_config_bert.json"


def hmp_defaults():
    """``{"hmp_bf16_ops": [...], "hmp_fp32_ops": [...]}``: optimum-habana's defaults."""
    config, _ = read_config(list_files.default_path(HMP_DEFAULTS_FILE))
    return {field: list(config[field]) for field in MODE_LISTS["use_habana_mixed_precision"]}


def _where(source):
    return f"hmp: gaudi config {source}"


def read_config(path_or_mapping):
    """Return ``(mapping, printable source)`` from a path or a mapping."""
    if isinstance(path_or_mapping, Mapping):
        return dict(path_or_mapping), "(mapping)"
    if not isinstance(path_or_mapping, (str, os.PathLike)):
        raise TypeError(
            f"hmp: convert_from_config takes a path (str or os.PathLike) or a mapping, "
            f"got {type(path_or_mapping).__name__}: {path_or_mapping!r}"
        )
    path = os.fspath(path_or_mapping)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise type(e)(e.errno, f"hmp: cannot read gaudi config {path!r}: {e.strerror}", path) from None
    try:
        config = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"hmp: gaudi config {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"hmp: gaudi config {path!r} must hold a JSON object, got {type(config).__name__}")
    return config, repr(path)


def _check_types(config, errors):
    for field in BOOL_FIELDS:
        value = config.get(field)
        if value is not None and not isinstance(value, bool):
            errors.append(f"{field}: must be true or false, got {value!r}")
    for field in STR_FIELDS:
        value = config.get(field)
        if value is not None and value not in OPT_LEVELS:
            errors.append(f"{field}: must be one of {', '.join(OPT_LEVELS)}, got {value!r}")
    for field in LIST_FIELDS:
        value = config.get(field)
        if value is not None and not isinstance(value, list):
            errors.append(f"{field}: must be a list of op names, got {type(value).__name__}: {value!r}")
    for field in MODULE_FIELDS.values():
        value = config.get(field)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            errors.append(f"{field}: must be a list of module class import paths or module names, got {value!r}")


def _check_modules(config, model, errors):
    """kind -> the classes and modules the module fields name."""
    out = {}
    for kind, field in MODULE_FIELDS.items():
        try:
            out[kind] = module_entries.from_parameter(config.get(field), model, field)
        except (ValueError, TypeError) as e:
            errors.append(str(e).removeprefix("hmp: "))
    return out


def _check_names(config, fields, resolver, errors):
    """Validated, de-duplicated op names for each of ``fields`` (None when
    absent). ``op.overload`` becomes its op; real aten operators that no
    Python name reaches are left out with one warning."""
    out, unreachable = {}, []
    for field in fields:
        value = config.get(field)
        if not isinstance(value, list):
            out[field] = None
            continue
        names = []
        for i, name in enumerate(value):
            where = f"{field}[{i}]"
            if not isinstance(name, str):
                errors.append(f"{where}: {name!r} is not an op name (a string)")
            elif not list_files.is_name(name):
                errors.append(f"{where}: {name!r} is not an op name")
            else:
                op, status, message = resolver.check(name)
                if status == UNKNOWN:
                    errors.append(f"{where}: {message}")
                elif status == NO_PYTHON:
                    unreachable.append(f"{where}: aten::{op}")
                elif op not in names:
                    names.append(op)
        out[field] = names
    return out, unreachable


def plan_from_config(path_or_mapping, model=None):
    """Validate a gaudi config and return what it asks for, changing nothing.

    Returns None when it asks for no mixed precision, else a dict with
    ``opt_level``, ``bf16`` and ``fp32`` (op names, or None for hmp's
    default list), ``modules`` (kind -> module classes and instances; names
    are matched against ``model``) and ``isVerbose`` (convert()'s names). Raises ValueError naming
    the field. ``path_or_mapping`` itself is not changed.
    """
    config, source = read_config(path_or_mapping)
    errors = []
    _check_types(config, errors)
    for field in sorted(set(config) - set(FIELDS)):
        log.debug("hmp: gaudi config %s: ignoring %s (not a mixed-precision field)", source, field)
    if errors:
        raise ValueError(f"{_where(source)}:\n  " + "\n  ".join(errors))

    modes = [m for m in MODE_LISTS if config.get(m) is True]
    if len(modes) == 2:
        raise ValueError(
            f"{_where(source)}: use_habana_mixed_precision and use_torch_autocast are both true; set one of them"
        )
    if not modes:
        return None
    mode = modes[0]
    bf16_field, fp32_field = MODE_LISTS[mode]
    for field in LIST_FIELDS:
        if field not in (bf16_field, fp32_field) and config.get(field) is not None:
            log.debug("hmp: gaudi config %s: ignoring %s (%s is true)", source, field, mode)

    opt_level, filled = PARAMETERS["opt_level"].default, []  # convert()'s, from its signature
    if mode == "use_habana_mixed_precision":
        opt_level = config.get("hmp_opt_level") or opt_level
        if opt_level == "O1":  # at O2 hmp uses its own lists, as Habana's HMP did
            for field, names in hmp_defaults().items():
                if config.get(field) is None:
                    config[field] = names
                    filled.append(field)
                    log.info(
                        "hmp: gaudi config %s: no %s; using optimum-habana's default (its BERT list): %s",
                        source,
                        field,
                        ", ".join(names),
                    )
    elif config.get("hmp_opt_level") is not None:
        log.debug("hmp: gaudi config %s: ignoring hmp_opt_level (use_torch_autocast is true)", source)

    resolver = Resolver()
    checked, unreachable = _check_names(config, (bf16_field, fp32_field), resolver, errors)
    by_module = _check_modules(config, model, errors)
    bf16, fp32 = checked[bf16_field], checked[fp32_field]
    if len(filled) == 1 and bf16 and fp32:  # the list given wins over the default one, as with list files
        given, other = (bf16, fp32) if filled == [fp32_field] else (fp32, bf16)
        other[:] = [n for n in other if n not in given]
    if bf16 and fp32:
        both = sorted(set(bf16) & set(fp32))
        if both:
            errors.append(f"ops in both {bf16_field} and {fp32_field}: {', '.join(both)}")
    if errors:
        raise ValueError(f"{_where(source)}:\n  " + "\n  ".join(errors))
    if unreachable:
        lists.warn_unreachable(f"gaudi config {source}: {', '.join(unreachable)}")
    return {
        "opt_level": opt_level,
        LOWER.name: bf16,
        FP32.name: fp32,
        "isVerbose": bool(config.get("hmp_is_verbose") or False),
        "modules": by_module,
        "source": source,
        "fields": (bf16_field, fp32_field),
    }


def convert_from_config(
    path_or_mapping: str | os.PathLike[str] | Mapping[str, Any],
    *,
    model: torch.nn.Module | None = None,
    low_precision_type: torch.dtype = PARAMETERS["low_precision_type"].default,
    cache: bool = PARAMETERS["cache"].default,
) -> None:
    """Apply an optimum-habana ``gaudi_config.json`` (a path or a mapping).

    ``use_habana_mixed_precision`` reads ``hmp_opt_level``, ``hmp_bf16_ops``,
    ``hmp_fp32_ops`` and ``hmp_is_verbose``; a missing ``hmp_*_ops`` list is
    optimum-habana's default for it (the BERT lists of
    op_lists/gaudi_config_bert.json). ``use_torch_autocast`` maps
    ``autocast_bf16_ops`` / ``autocast_fp32_ops`` onto the same lists (O1); a
    missing one there means hmp's default list of that kind. hmp's own
    ``hmp_fp32_modules`` / ``hmp_bf16_modules`` (in either mode) list module
    classes by import path, or module names matched against ``model``'s
    ``named_modules()``, to run under that rule (``fp32_modules`` of
    :func:`hmp.convert`). Other fields (``use_fused_adam``, ...) are ignored
    (logged at DEBUG).

    Returns True when hmp was converted. When neither mode is true, hmp is
    reverted and False is returned. A wrong type, an unknown op or both
    modes at once raise ValueError naming the field, before anything changes.
    """
    wanted = plan_from_config(path_or_mapping, model)
    if wanted is None:
        revert()
        return False
    given = [
        Names(names, f"{field} of gaudi config {wanted['source']}") if names is not None else ""
        for names, field in zip((wanted[LOWER.name], wanted[FP32.name]), wanted["fields"])
    ]
    modules = {k.modules_parameter: wanted["modules"][k.name] for k in kinds.KINDS if k.takes_modules}
    convert(
        wanted["opt_level"],
        isVerbose=wanted["isVerbose"],
        low_precision_type=low_precision_type,
        cache=cache,
        **{LOWER.parameter: given[0], FP32.parameter: given[1]},
        **modules,
    )
    return True
