"""A wrapper's life, decided at convert time: made (``make``: the body standing in for its op and
scripted by TorchScript as the original), what it does (``record``, a core.wrap.Spec, changed
only whole by ``swap``), paused to a plain call, resumed with a conversion's rule, re-armed for a
site another library holds (``take_over``), retired by revert(), and dynamo made ready before
wrappers go in. The body that runs per call is hmp/core/wrap.py's."""

import threading
import types
import weakref

import torch

from hmp.core import cast_copies, torch_private
from hmp.core.identity import stand_in, unwrap
from hmp.core.state import graph_off
from hmp.core.wrap import _BODY, NEVER, PAUSED, Spec, made


def make(
    op,
    prepare,
    about,
    original=None,
    src=None,
    cast=None,
    limit=None,
    inplace_at=NEVER,
    hidden=True,
    needs=None,
    eager_prepare=None,
):
    """The wrapper of ``op``, casting through ``prepare``; ``about`` (a rescue.About)
    describes it for the error path.

    ``original``: what ``op`` adapts, if it is an adapter. ``hidden``: ``op`` may
    write an argument undeclared (a Python function), so writes into cast copies are
    carried back. ``needs(args, kwargs)``: False for a call left alone. ``src``,
    ``cast``, ``limit``, ``inplace_at``: the lean path for calls without keywords
    (tensors of a dtype in ``src`` go through ``cast``; ``src=policy.PROMOTE`` runs a
    one-dtype call as given). ``eager_prepare``: ``prepare`` on the casters' eager
    forms, for eager code (None: ``prepare``)."""
    original = op if original is None else original
    eager_prepare = prepare if eager_prepare is None else eager_prepare
    cast_any, eager = (None, None) if cast is None else cast
    # torch's own code may call ``op`` by name while a captured graph is lowered; never an operator
    name = getattr(op, "__name__", "")
    lowers = not (name.startswith("__") and name.endswith("__"))
    spec = Spec(op, prepare, about, src, cast_any, eager, limit, inplace_at, hidden, needs, eager_prepare, lowers)
    return finish(made(spec), original)


def finish(wrapper, op):
    """``wrapper`` standing in for ``op`` (identity.stand_in) and scripted as torch's own."""
    stand_in(wrapper, op)
    script_as(wrapper, unwrap(op))
    return wrapper


_forget_builtin = torch_private.jit_forget_builtin


def script_as(wrapper, original):
    """Make TorchScript compile ``wrapper`` as ``original``: scripted code runs its ops
    uncast, like any call hmp cannot see.

    An aten builtin (``torch.relu``) gets the wrapper registered as the same builtin
    (torch_private.jit_register_builtin, private: no public way scripts a call of a
    builtin's wrapper), dropped when the wrapper is collected; a Python original
    (``F.relu``) is compiled from its source through ``__prepare_scriptable__``.
    tests/unit/binding/test_interop_jit_refs.py fails without the table."""
    builtin = torch_private.jit_find_builtin(original)
    if builtin is not None:
        torch_private.jit_register_builtin(wrapper, builtin)
        weakref.finalize(wrapper, _forget_builtin, id(wrapper))
    elif isinstance(original, types.FunctionType):
        wrapper.__prepare_scriptable__ = lambda: original


def record(wrapper):
    """What a wrapper does now: its core.wrap.Spec."""
    return Spec(*wrapper.__closure__[0].cell_contents)


def swap(wrapper, spec):
    """Make ``wrapper`` do what ``spec`` (a core.wrap.Spec) says, in one step: a call in progress
    finishes under the record it started with."""
    wrapper.__closure__[0].cell_contents = tuple(spec)


def fields(wrapper):
    """What a wrapper does: ``make``'s arguments, by name."""
    spec = record(wrapper)
    found = {name: getattr(spec, name) for name in _MADE}
    found["cast"] = None if spec.cast_any is None else cast_copies.Cast(spec.cast_any, spec.eager)
    return found


_MADE = ("op", "prepare", "about", "src", "limit", "inplace_at", "hidden", "needs", "eager_prepare")  # and cast


_ready_lock = threading.Lock()  # two threads' first convert() do it one after the other


def ready_for_compile():
    """Import dynamo before convert() installs wrappers, so what it reads from torch's
    namespaces at import is torch's own and a later compile gets one graph.
    Idempotent; importing dynamo can take a second."""
    with _ready_lock:
        torch_private.import_dynamo()
        # a change of the cast state while dynamo traces is a node of the graph (state.graph_off),
        # kept by dead-code elimination: its lowering replays it
        torch.compiler.allow_in_graph(graph_off)
        torch.fx.node.has_side_effect(graph_off)


def is_wrapper(obj):
    return getattr(obj, "__code__", None) is _BODY


def pause(wrapper):
    """Make a wrapper a plain call of what it wraps (its ``prepare`` PAUSED)."""
    swap(wrapper, record(wrapper)._replace(prepare=PAUSED))


def resume(wrapper, prepare, eager_prepare=None):
    """Make a paused wrapper cast again, through ``prepare`` (and ``eager_prepare`` in eager code)."""
    eager_prepare = prepare if eager_prepare is None else eager_prepare
    swap(wrapper, record(wrapper)._replace(prepare=prepare, eager_prepare=eager_prepare))


def take_over(wrapper, donor):
    """Give ``wrapper`` (an hmp wrapper another library holds: it wrapped it,
    or saved it to put back later) everything ``donor``, a wrapper built for
    the same op by this conversion, would do: its record."""
    swap(wrapper, record(donor))
    wrapper.__qualname__ = donor.__qualname__


def retire(wrapper):
    """Turn a wrapper revert() took out of torch into a plain call of the original, so
    references captured while converted behave as the original; its qualname says
    why pickling it fails. Non-wrappers are left alone."""
    if not is_wrapper(wrapper):
        return
    swap(wrapper, record(wrapper)._replace(op=unwrap(wrapper), prepare=PAUSED))
    # pickle saves a function by name and the name now finds the original:
    # the error it raises shows this name, which says what to do
    wrapper.__qualname__ = (
        f"{wrapper.__qualname__} [an hmp wrapper retired by revert(): pickle the state_dict, "
        f"or build the module after revert()]"
    )
