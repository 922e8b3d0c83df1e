"""Errors that explain themselves: the note hmp adds to a dtype mismatch.

When an op raises because it got a lower-precision (bfloat16/float16)
tensor and a float32 one, one line is added with ``add_note`` (Python 3.11+;
older Pythons get no note) naming the op and the list it probably belongs
in (hmp/diagnostics/culprit.py finds the op). The user's exception object is always the
one raised, with its type and message unchanged.

The note is added where the exception passes through hmp, and nowhere else:
an op's wrapper (hmp/core/rescue.py), the backward wrapper
(``_uncast_backward`` in hmp/rules/regions.py), and ``python -m hmp run``
(hmp/integrations/habana_runner.py), which catches the script's uncaught
exception and calls ``explain`` before reporting it. hmp replaces no
exception hook: a mismatch raised by an op in no list (or a listed op
called with casts off), called outside anything hmp wraps, gets no note in
a plain ``python script.py``; the script can pass the exception to
``explain`` itself, or run under ``python -m hmp run``.
"""

import functools
import re

from hmp.binding import kinds, list_files, lists
from hmp.binding.kinds import FP32, LOWER, PROMOTE
from hmp.binding.pays import NORMALIZATIONS
from hmp.core import state, torch_private
from hmp.diagnostics import culprit

_LOW = re.compile(r"BFloat16|bfloat16|\bHalf\b|\bhalf\b|float16")
_FP32 = re.compile(r"\bFloat\b|\bfloat\b|float32|FloatTensor")
_MIXED = re.compile(torch_private.MIXED_DTYPE_MESSAGE)
_HOOK = re.compile(torch_private.HOOK_CHANGED_TYPE_MESSAGE)
_PREFIX = "hmp: "
# names that are probably compute-bound (BF16) or precision-sensitive (FP32)
# when the shipped lists do not say
_BF16_LIKE = re.compile(r"mm|mv|matmul|linear|conv|dot|einsum|tensordot|inner|outer|ger|attention")
_FP32_LIKE = re.compile(r"loss|entropy|softmax|norm|log|exp|sum|mean|var|std|prod|cum")


def _low():
    """The lower dtype of the conversion in force, or None."""
    conversion = state.runtime.conversion
    return conversion.options.low_precision_type if conversion is not None else None


def _record(kind):
    """The record of ``kind``: a wrapper's (a kinds.Kind already), or a list
    lookup's name; None for neither (a note never raises)."""
    if isinstance(kind, kinds.Kind):
        return kind
    return next((k for k in kinds.KINDS if k.name == kind), None)


def _title(kind):
    record = _record(kind)
    return record.title_in(_low()) if record is not None else kind


def is_mismatch(exc):
    """True when the message says a lower-precision and a float32 tensor met."""
    if not isinstance(exc, (RuntimeError, ValueError, TypeError)) or not exc.args:
        return False
    msg = str(exc.args[0])
    return bool((_LOW.search(msg) and _FP32.search(msg)) or _MIXED.search(msg))


def _note_of(exc):
    """The hmp note already on ``exc``, or None."""
    return next((n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n.startswith(_PREFIX)), None)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=1)
def _shipped(records):
    """Op names of the shipped O1 lists of the kinds ``records`` (kinds.KINDS: a kind added
    there is read too), with O2's lower list in BF16 (O2's FP32 list holds ops that O1 runs in bf16)."""
    files = {k: [k.defaults["O1"]] for k in records}
    files[LOWER].append(LOWER.defaults["O2"])
    out = {}
    for kind, names in files.items():
        out[kind] = set()
        for f in names:
            try:
                out[kind].update(list_files.names(list_files.default_path(f)))
            except (OSError, ValueError):
                pass
    return out


def probable_list(name):
    """The list an op probably belongs in: the shipped lists first, then its name."""
    shipped = _shipped(kinds.KINDS)
    for kind in kinds.KINDS:
        if name in shipped[kind]:
            return kind
    if _BF16_LIKE.search(name):
        return LOWER
    if _FP32_LIKE.search(name):
        return FP32
    return PROMOTE


def _kind_of(name):
    conversion = state.runtime.conversion
    for kind in kinds.KINDS:
        if conversion is not None and name in conversion.lists[kind]:
            return kind
    return None


def _explain_python_check(frame):
    """One line for a mismatch that Python code raised itself, before any op ran."""
    code = frame.f_code
    where = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{frame.f_lineno})"
    module = frame.f_locals.get("self")
    kernel = (
        torch_private.RNN_MODES.get(getattr(module, "mode", None))
        if code.co_name == torch_private.RNN_CHECK_INPUT
        else None
    )
    if kernel is None:
        return (
            f"hmp: {where} checked dtypes itself and raised before any op ran; hmp casts only at op calls, so "
            f"no list entry changes this check: give the call the dtype it expects."
        )
    name = type(module).__name__
    listed = _kind_of(kernel)
    if listed is None:
        return (
            f"hmp: {name} checks in Python that its input and weights share a dtype ({where}); its kernel "
            f"'{kernel}' is in no hmp list. List '{kernel}' in the {_title(LOWER)} or FP32 list and hmp runs "
            f"the whole "
            f"{name} in that dtype, input, hidden state and weights ({lists.how_to_add(kernel, FP32, _low())})."
        )
    return (
        f"hmp: {name} checks in Python that its input and weights share a dtype ({where}); '{kernel}' is in "
        f"the {_title(listed)} list, but this call ran with hmp's casts off (hmp.disable_casts()), "
        f"so nothing "
        f"gave them one dtype."
    )


def _explain_hook(match):
    """Autograd's check that a hook kept its value's dtype: no op and no list
    entry is involved, so the note must not suggest one."""
    name, was, got = match.groups()
    change = f" ({was} -> {got})" if was and got else ""
    return (
        f"hmp: hook '{name}' returned a value of another dtype than it was given{change}; autograd requires "
        f"a hook to keep the dtype. This is not a missing list entry: under hmp a gradient can be bf16 where "
        f"it used to be float32, so return a value of the dtype given (`return result.to(grad.dtype)`)."
    )


def _explain(exc, about, in_backward=False):
    """One line for a dtype mismatch. ``about`` is the About of the hmp
    wrapper the exception passed through, or None; ``in_backward``: raised
    in a backward pass."""
    hook = _HOOK.search(str(exc.args[0])) if exc.args else None
    if hook is not None:
        return _explain_hook(hook)
    if in_backward:
        return _explain_backward(exc)
    callee = culprit.callee(exc)
    label, name, kind = about[:3] if about is not None else (None, None, None)
    if about is not None and about.uncast:
        where = f"{label} ({_title(kind)} list)" if kind is not None else label
        inner = f" ({callee} inside it)" if callee is not None and callee != name else ""
        return (
            f"hmp: {where} ran uncast, with hmp's casts off for this block (hmp.disable_casts(), or an FP32 "
            f"module entry), and got lower-precision and float32 tensors{inner}: cast the input in the block "
            f"(`x.float()`), or widen the block to take in the op that made it lower-precision."
        )
    if callee is not None and label is not None and callee != name:
        if name:
            where = f"{label} ({_title(kind)} list)"
            fix = (
                f"take '{name}' out of the lists and list the ops it calls ('{callee}' probably belongs in the "
                f"{_title(probable_list(callee))} list)"
            )
        elif kind:
            where, fix = f"{label} (@hmp.{kind.name}_function)", "cast their inputs inside it"
        else:
            where, fix = f"{label} (wrapped by hmp.op_wrap)", "cast their inputs inside it"
        return (
            f"hmp: {callee} got lower-precision and float32 tensors inside {where}; hmp does not cast calls "
            f"made inside a wrapped op, so {fix}."
        )
    if callee is not None:
        listed = _kind_of(callee)
        if listed is None:
            advice = probable_list(callee)
            return (
                f"hmp: {callee} got lower-precision and float32 tensors and is in no hmp list; it probably "
                f"belongs in the {_title(advice)} list ({lists.how_to_add(callee, advice, _low())})."
            )
        if label is None:
            return (
                f"hmp: '{callee}' is in the {_title(listed)} list but this call was not cast: it ran inside "
                f"hmp.disable_casts(), or through a reference taken before hmp.convert() "
                f"(`from torch import {callee}`)."
            )
    if label is not None and name is not None:
        record = _record(kind)
        if record is not None and record.norms is not None and name in NORMALIZATIONS:
            return (
                f"hmp: {label} ({_title(kind)} list) got lower-precision and float32 tensors: hmp casts only "
                f"the input "
                f"of normalization ops, so its weight, bias and statistics keep their dtypes; give them one "
                f"dtype, or move '{name}' to the FP32 list ({lists.how_to_add(name, FP32, _low())})."
            )
        return (
            f"hmp: {label} ({_title(kind)} list) got lower-precision and float32 tensors "
            f"after hmp's "
            f"casts (hmp casts tensor arguments and tensors inside a list/tuple argument); the promote list "
            f"would give all its floating inputs one dtype."
        )
    if label is not None and kind:
        return (
            f"hmp: {label} (@hmp.{kind.name}_function) got lower-precision and float32 tensors after hmp's casts; "
            f"cast inside it what it makes itself."
        )
    if label is not None:  # op_wrap
        return f"hmp: {label} (hmp.op_wrap) got lower-precision and float32 tensors after its cast_fn."
    frame = culprit.raising_frame(exc) if callee is None else None
    if frame is not None:
        return _explain_python_check(frame)
    return (
        "hmp: an op got lower-precision and float32 tensors; an op missing from hmp's lists is the usual "
        "cause (see hmp.effective_lists())."
    )


def _explain_backward(exc):
    """One line for a mismatch raised in a backward pass, where hmp casts nothing."""
    callee = culprit.callee(exc)
    op = f"'{callee}'" if callee else "an op"
    return (
        f"hmp: {op} got lower-precision and float32 tensors in a backward pass. hmp casts nothing in "
        f"backward: each op's gradient follows the dtypes its forward ran in, so a hand-written backward (a "
        f"custom autograd.Function) sees what its forward produced. Decorate the Function with "
        f"torch.amp.custom_fwd(cast_inputs=torch.float32) and custom_bwd, which hmp honours as torch.autocast "
        f"does, or cast inside the backward."
    )


def annotate(exc, about=None, in_backward=False):
    """Add the mismatch note to ``exc`` (once); ``about`` describes the hmp
    wrapper it passed through, if any; ``in_backward``: it was raised in a
    backward pass. Never raises."""
    try:
        if hasattr(exc, "add_note") and _note_of(exc) is None and is_mismatch(exc):
            exc.add_note(_explain(exc, about, in_backward))
    except Exception:  # a note must never replace the user's error
        pass


def explain(exc):
    """hmp's note on ``exc``, for an error that passed through nothing hmp
    wraps (an op in no list called by the user's code, which no wrapper
    noted): added to it once (Python 3.11+) and returned. None when ``exc``
    is not a dtype mismatch, or hmp is not converted and no wrapper noted
    it (the lists a note names are the conversion's). Never raises."""
    try:
        note = _note_of(exc)
        if note is not None:
            return note
        if state.runtime.conversion is None or not is_mismatch(exc):
            return None
        line = _explain(exc, None)
        if hasattr(exc, "add_note"):
            exc.add_note(line)
        return line
    except Exception:  # a note must never replace the user's error
        return None
