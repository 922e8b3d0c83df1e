"""What the conversion in force says, read without changing anything: whether one is in force, which
it is, and what its lists do (effective_lists). convert(), revert() and the blocks that apply a
conversion are conversion.py's."""

from hmp.binding import engine as engine_plan
from hmp.binding import kinds, lists, module_entries, pays
from hmp.binding.module_entries import Pattern
from hmp.core.state import runtime


def is_converted() -> bool:
    return runtime.conversion is not None


def in_force():
    """The Conversion in force, or None; ``restore()`` takes it (a thread's cast
    state is ``state.current()``)."""
    return runtime.conversion


def effective_lists(detail: bool = False) -> dict:
    """Each list kind's public name (``"bf16"``, ``"fp32"``, ``"promote"``:
    hmp/binding/kinds.py) to the sorted op names of its list
    and, after them, its module entries as a list file names them (a
    class's import path, or a pattern); empty when not converted.

    ``detail=True``: each list maps every entry to what hmp does with it:
    ``"cast"``, or why it is not (it gains nothing from the lower dtype
    outside strict mode, returns a view, torch already promotes it), and a
    module entry to ``"module entry: ..."`` (hmp/binding/pays.py)."""
    conversion = runtime.conversion
    if conversion is None:
        return {k: {} if detail else [] for k in kinds.names()}
    named = {
        k: sorted(module_entries.entry_key(t) for t in conversion.modules.get(k, ()) if isinstance(t, (type, Pattern)))
        for k in kinds.KINDS
    }
    if not detail:
        return {k.name: sorted(v) + named[k] for k, v in conversion.lists.items()}
    # the engine's delegated names are keyed as autocast's probe answers: by the kinds' public names
    decided = engine_plan.says({k.name: v for k, v in decisions(conversion).items()})
    return {
        k.name: {**decided[k.name], **{m: f"module entry: {k.module_says}" for m in named[k]}} for k in conversion.lists
    }


def decisions(conversion):
    """``{kind: {op name: "cast" or why not}}`` (by kinds.Kind) for a Conversion's op entries,
    sorted: what each line of its lists does (hmp/binding/pays.py)."""
    strict, one_dtype = conversion.options.strict, lists.one_dtype_names()
    return {k: {n: pays.decision(k, n, strict, one_dtype)[1] for n in sorted(v)} for k, v in conversion.lists.items()}
