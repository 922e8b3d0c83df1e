"""Errors that help, and no new errors: what hmp does when an op raises.

Everything here runs only on the error path: from the ``except`` clause of
the per-call wrappers (free in Python 3.11 when nothing is raised) and from
the exception hooks that convert() installs. The user's exception object is
always the one re-raised, with its type and message unchanged; at most one
line is added with ``add_note`` (Python 3.11+; older Pythons get no note).

- **Dtype mismatches.** When an op raises because it got a lower-precision
  (bfloat16/float16) tensor and a float32 one, the note names the op and the
  list it probably belongs in. The op is found from the innermost traceback
  frame: when that frame is an hmp wrapper, the listed op itself raised;
  otherwise the source of the call being executed there (the exact
  expression, from Python 3.11's code positions) names it, e.g.
  ``torch.addmm(...)``, ``x.mm(...)`` or ``a @ b``, checked against torch
  with ``Resolver().exists``. An error raised outside any wrapper (an op in
  no list, called by the user) gets its note from ``sys.excepthook`` /
  ``threading.excepthook`` when it is not caught; see ``install_hooks``.
- **No kernel for the lower dtype.** When torch reports that the op it was
  called with has no kernel for the dtype hmp cast to (``"addmm_..." not
  implemented for 'BFloat16'``, e.g. sparse matmul on CPU), the op is run
  again with its arguments as given, as if it were in no list, or, when that
  fails too and the call writes none of its arguments, with its
  lower-precision arguments in float32 (an earlier listed op may have made
  them bf16); hmp warns once per op. Only when the op itself raised that
  error (a C function, so nothing ran before the kernel was chosen) and hmp
  had cast something; otherwise the original error is raised.

Limits of naming the op: the source must be readable (linecache) and
unchanged since it was loaded; an error raised in Python code (``raise
ValueError`` inside ``nn.LSTM``) or in C++ called by C++ (autograd's
backward) names no op and gets a generic line; a caught exception that never
passed through an hmp wrapper gets no note (only uncaught ones reach the
hooks; IPython/Jupyter print tracebacks without sys.excepthook).
"""

import ast
import dis
import functools
import itertools
import linecache
import re
import sys
import threading
import warnings
from typing import NamedTuple, Optional

RAISE = object()  # failed(): re-raise the exception


class About(NamedTuple):
    """What a wrapper's error path needs to know about its entry point."""

    label: str  # torch.nn.functional.layer_norm
    name: Optional[str] = None  # the list name, layer_norm (None for op_wrap)
    kind: Optional[str] = None  # "bf16", "fp32" or "promote"
    inplace: bool = False  # X_ / __iX__: the first argument is written
    inplace_param: Optional[int] = None  # position of an inplace= parameter

    def writes(self, args, kwargs):
        """True when this call writes one of its arguments."""
        if self.inplace or (kwargs and (kwargs.get("out") is not None or kwargs.get("inplace"))):
            return True
        i = self.inplace_param
        return i is not None and len(args) > i and bool(args[i])


_LOW = re.compile(r"BFloat16|bfloat16|\bHalf\b|\bhalf\b|float16")
_FP32 = re.compile(r"\bFloat\b|\bfloat\b|float32|FloatTensor")
_MIXED = re.compile(r"mixed dtype")
_NO_KERNEL = re.compile(r"not implemented for '(BFloat16|Half)'")
_HOOK = re.compile(r"hook '([^']*)' has changed the type of value(?: \(was (\S+) got (\S+)\))?")
_PREFIX = "hmp: "
_TITLE = {"bf16": "BF16", "fp32": "FP32", "promote": "promote"}
_PARAM = {"bf16": "bf16_file_path", "fp32": "fp32_file_path", "promote": "promote_file_path"}
_OPERATORS = {ast.MatMult: "matmul", ast.Mult: "mul", ast.Div: "truediv", ast.Add: "add", ast.Sub: "sub",
              ast.Pow: "pow", ast.Mod: "remainder", ast.FloorDiv: "floor_divide"}
# names that are probably compute-bound (BF16) or precision-sensitive (FP32)
# when the shipped lists do not say
_BF16_LIKE = re.compile(r"mm|mv|matmul|linear|conv|dot|einsum|tensordot|inner|outer|ger|attention")
_FP32_LIKE = re.compile(r"loss|entropy|softmax|norm|log|exp|sum|mean|var|std|prod|cum")
_warned = set()


# -- classification ------------------------------------------------------------------


def is_mismatch(exc):
    """True when the message says a lower-precision and a float32 tensor met."""
    if not isinstance(exc, (RuntimeError, ValueError, TypeError)) or not exc.args:
        return False
    msg = str(exc.args[0])
    return bool((_LOW.search(msg) and _FP32.search(msg)) or _MIXED.search(msg))


def _noted(exc):
    return any(isinstance(n, str) and n.startswith(_PREFIX) for n in getattr(exc, "__notes__", ()))


def _innermost(tb):
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _in_wrapper(tb):
    from . import wrap

    return tb is not None and tb.tb_frame.f_code.co_filename == wrap.__file__


def _source(tb):
    """The source of the expression the frame was executing, or its line."""
    code, filename = tb.tb_frame.f_code, tb.tb_frame.f_code.co_filename
    if hasattr(code, "co_positions") and tb.tb_lasti >= 0:
        try:
            start, end, col, end_col = next(itertools.islice(code.co_positions(), tb.tb_lasti // 2, None))
        except (StopIteration, ValueError, TypeError):
            start = None
        if start is not None and end is not None and col is not None and end_col is not None:
            lines = [linecache.getline(filename, n).encode("utf-8") for n in range(start, end + 1)]
            if all(lines):
                if len(lines) == 1:
                    text = lines[0][col:end_col]
                else:
                    text = lines[0][col:] + b"".join(lines[1:-1]) + lines[-1][:end_col]
                return text.decode("utf-8", "replace")
    return linecache.getline(filename, tb.tb_lineno).strip() or None


def _called_name(text):
    """The op name a source snippet calls: ``torch.addmm(..)`` -> addmm,
    ``x.mm(..)`` -> mm, ``a @ b`` -> matmul; None when it is not one call."""
    tree = None
    for mode in ("eval", "exec"):
        try:
            tree = ast.parse(text.strip(), mode=mode)
            break
        except SyntaxError:
            continue
    if tree is None:
        return None
    node = tree.body if mode == "eval" else (tree.body[0] if len(tree.body) == 1 else None)
    if isinstance(node, ast.Expr):
        node = node.value
    if isinstance(node, (ast.Assign, ast.Return)) and isinstance(node.value, ast.Call):
        node = node.value  # a whole line: its outermost call
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            return func.id
        return None
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        return _OPERATORS.get(type(node.op))
    return None


def _list_name(name):
    """The list name for an attribute name: ``__rmul__`` -> mul, ``mul_`` -> mul."""
    from .resolve import Resolver

    resolver = Resolver()
    candidates = [name]
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        candidates = [core, core[1:]] if core[:1] in ("r", "i") else [core]
    elif name.endswith("_") and not name.startswith("_"):
        candidates = [name[:-1], name]
    return next((c for c in candidates if resolver.exists(c)), None)


def _callee(exc):
    """The torch op the innermost frame was calling when ``exc`` was raised,
    or None when it is unknown or the wrapper handling ``exc`` called it."""
    first = exc.__traceback__
    tb = _innermost(first)
    if tb is None:
        return None
    if _in_wrapper(tb):
        if tb is first:  # the wrapper now handling exc: its own op raised
            return None
        # an inner wrapper that called its op uncast (disable_casts, or inside a wrapped op)
        name = getattr(tb.tb_frame.f_locals.get("op"), "__name__", None)
        return _list_name(name) if isinstance(name, str) else None
    text = _source(tb)
    name = _called_name(text) if text else None
    return _list_name(name) if name else None


@functools.lru_cache(maxsize=1)
def _shipped():
    from . import lists

    out = {}
    for kind, files in (("bf16", ("bf16.txt", "o2_bf16.txt")), ("fp32", ("fp32.txt",)), ("promote", ("promote.txt",))):
        names = set()
        for f in files:
            try:
                names.update(n for _, n in lists.read_names(lists.default_path(f)))
            except (OSError, ValueError):
                pass
        out[kind] = names
    return out


def probable_list(name):
    """The list an op probably belongs in: the shipped lists first, then its name."""
    shipped = _shipped()
    for kind in ("bf16", "fp32", "promote"):
        if name in shipped[kind]:
            return kind
    if _BF16_LIKE.search(name):
        return "bf16"
    if _FP32_LIKE.search(name):
        return "fp32"
    return "promote"


def _kind_of(name):
    from .convert import runtime

    current = runtime.lists or {}
    for kind in ("bf16", "fp32", "promote"):
        if name in current.get(kind, ()):
            return kind
    return None


def _raised_by_python(exc):
    """The frame whose own ``raise`` statement raised ``exc`` (a module's dtype
    check, such as nn.RNNBase.check_input), or None when an op raised it."""
    tb = _innermost(exc.__traceback__)
    if tb is None or _in_wrapper(tb):
        return None
    code = tb.tb_frame.f_code
    if not 0 <= tb.tb_lasti < len(code.co_code) or dis.opname[code.co_code[tb.tb_lasti]] != "RAISE_VARARGS":
        return None
    return tb.tb_frame


def _explain_python_check(frame):
    """One line for a mismatch that Python code raised itself, before any op ran."""
    code = frame.f_code
    where = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{frame.f_lineno})"
    module = frame.f_locals.get("self")
    from .rnn import MODES

    kernel = MODES.get(getattr(module, "mode", None)) if code.co_name == "check_input" else None
    if kernel is None:
        return (f"hmp: {where} checked dtypes itself and raised before any op ran; hmp casts only at op calls, so "
                f"no list entry changes this check: give the call the dtype it expects.")
    name = type(module).__name__
    listed = _kind_of(kernel)
    if listed is None:
        return (f"hmp: {name} checks in Python that its input and weights share a dtype ({where}); its kernel "
                f"'{kernel}' is in no hmp list. List '{kernel}' (BF16 or FP32 list) and hmp runs the whole {name} "
                f"in that dtype, input, hidden state and weights.")
    return (f"hmp: {name} checks in Python that its input and weights share a dtype ({where}); '{kernel}' is in "
            f"the {_TITLE[listed]} list, but this call ran with hmp's casts off (hmp.disable_casts()), so nothing "
            f"gave them one dtype.")


def _explain_hook(match):
    """Autograd's check that a hook kept its value's dtype: no op and no list
    entry is involved, so the note must not suggest one."""
    name, was, got = match.groups()
    change = f" ({was} -> {got})" if was and got else ""
    return (f"hmp: hook '{name}' returned a value of another dtype than it was given{change}; autograd requires "
            f"a hook to keep the dtype. This is not a missing list entry: under hmp a gradient can be bf16 where "
            f"it used to be float32, so return a value of the dtype given (`return result.to(grad.dtype)`).")


def _explain(exc, site):
    """One line for a dtype mismatch. ``site`` is the About of the hmp
    wrapper the exception passed through, or None."""
    hook = _HOOK.search(str(exc.args[0])) if exc.args else None
    if hook is not None:
        return _explain_hook(hook)
    callee = _callee(exc)
    label, name, kind = site[:3] if site is not None else (None, None, None)
    if callee is not None and label is not None and callee != name:
        if name:
            where = f"{label} ({_TITLE[kind]} list)"
            fix = (f"take '{name}' out of the lists and list the ops it calls ('{callee}' probably belongs in the "
                   f"{_TITLE[probable_list(callee)]} list)")
        else:
            where, fix = f"{label} (wrapped by hmp.op_wrap)", "cast their inputs inside it"
        return (f"hmp: {callee} got lower-precision and float32 tensors inside {where}; hmp does not cast calls "
                f"made inside a wrapped op, so {fix}.")
    if callee is not None:
        listed = _kind_of(callee)
        if listed is None:
            advice = probable_list(callee)
            return (f"hmp: {callee} got lower-precision and float32 tensors and is in no hmp list; it probably "
                    f"belongs in the {_TITLE[advice]} list (add '{callee}' to the file you pass as {_PARAM[advice]}).")
        if label is None:
            return (f"hmp: '{callee}' is in the {_TITLE[listed]} list but this call was not cast: it ran inside "
                    f"hmp.disable_casts(), or through a reference taken before hmp.convert() "
                    f"(`from torch import {callee}`).")
    if label is not None and name is not None:
        from .policy import NORM_OPS

        if kind == "bf16" and name in NORM_OPS:
            return (f"hmp: {label} (BF16 list) got lower-precision and float32 tensors: hmp casts only the input "
                    f"of normalization ops, so its weight, bias and statistics keep their dtypes; give them one "
                    f"dtype, or move '{name}' to the FP32 list.")
        return (f"hmp: {label} ({_TITLE.get(kind, kind)} list) got lower-precision and float32 tensors after hmp's "
                f"casts (hmp casts tensor arguments and tensors inside a list/tuple argument); the promote list "
                f"would give all its floating inputs one dtype.")
    if label is not None:  # op_wrap
        return f"hmp: {label} (hmp.op_wrap) got lower-precision and float32 tensors after its cast_fn."
    frame = _raised_by_python(exc) if callee is None else None
    if frame is not None:
        return _explain_python_check(frame)
    return ("hmp: an op got lower-precision and float32 tensors; an op missing from hmp's lists is the usual "
            "cause (see hmp.effective_lists()).")


def annotate(exc, site=None):
    """Add the mismatch note to ``exc`` (once). Never raises."""
    try:
        if hasattr(exc, "add_note") and not _noted(exc) and is_mismatch(exc):
            exc.add_note(_explain(exc, site))
    except Exception:  # a note must never replace the user's error
        pass


# -- the wrappers' except clause -------------------------------------------------------------


def failed(exc, op, site, args, kwargs, cast_args, cast_kwargs):
    """Called by a wrapper whose op raised ``exc`` (casting is still off in
    this thread). ``args``/``kwargs`` are the call as given, ``cast_*`` as
    hmp changed it. Returns a result when torch had no kernel for the dtype
    hmp cast to and the op runs without that cast, else RAISE (after
    annotating ``exc``)."""
    try:
        cast_something = cast_args is not args or cast_kwargs is not kwargs
        if (cast_something and isinstance(exc, (NotImplementedError, RuntimeError)) and exc.args
                and _NO_KERNEL.search(str(exc.args[0])) and _in_wrapper(_innermost(exc.__traceback__))):
            result, how = _without_the_cast(op, site, args, kwargs)
            if how is not None:
                label = site.label if site else getattr(op, "__name__", repr(op))
                if label not in _warned:
                    _warned.add(label)
                    first = str(exc.args[0]).splitlines()[0]
                    warnings.warn(f"hmp: {label} has no kernel for the dtype hmp cast its inputs to ({first}); "
                                  f"it ran {how}. Call it inside hmp.disable_casts() or change its list to "
                                  f"silence this.", RuntimeWarning, stacklevel=3)
                return result
    except Exception:
        pass
    annotate(exc, site)
    return RAISE


def _without_the_cast(op, site, args, kwargs):
    """Run the op with its arguments as given, or else (when it writes none
    of them) with its lower-precision arguments in float32. Returns
    ``(result, how)``; ``how`` is None when both fail."""
    try:
        return op(*args, **kwargs), "with its inputs as given"
    except Exception:
        pass
    if site is None or site.writes(args, kwargs):
        return None, None  # a written tensor is never replaced by a copy
    from .policy import FP32, PLAIN_CASTS, fp32

    up_args, up_kwargs = fp32(PLAIN_CASTS)(args, kwargs)
    if up_args is args and up_kwargs is kwargs:
        return None, None
    try:
        return op(*up_args, **up_kwargs), f"in {str(FP32).replace('torch.', '')}"
    except Exception:
        return None, None


# -- exception hooks for errors raised outside any wrapper -------------------------------------

_hooks = {"active": False, "sys": None, "threading": None}


def _sys_hook(exc_type, exc, tb):
    if _hooks["active"]:
        annotate(exc)
    return _hooks["sys"](exc_type, exc, tb)


def _threading_hook(hook_args):
    if _hooks["active"]:
        annotate(hook_args.exc_value)
    return _hooks["threading"](hook_args)


def install_hooks():
    """Chain hmp's note into sys.excepthook and threading.excepthook, so an
    uncaught mismatch raised by an op in no list names that op. Called by
    convert() under its lock."""
    if sys.excepthook is not _sys_hook and _hooks["sys"] is None:
        _hooks["sys"] = sys.excepthook
        sys.excepthook = _sys_hook
    if threading.excepthook is not _threading_hook and _hooks["threading"] is None:
        _hooks["threading"] = threading.excepthook
        threading.excepthook = _threading_hook
    _hooks["active"] = True


def remove_hooks():
    """Put the previous hooks back. A hook that someone replaced after
    convert() stays in their chain, inert (it only passes calls on)."""
    _hooks["active"] = False
    if sys.excepthook is _sys_hook:
        sys.excepthook, _hooks["sys"] = _hooks["sys"], None
    if threading.excepthook is _threading_hook:
        threading.excepthook, _hooks["threading"] = _hooks["threading"], None
