"""Where torch.autocast acts besides the ops it has a kernel for (engine="autocast",
hmp/binding/engine.py): in an op whose kernels call one it casts. Autocast is a dispatch key
and a call made inside a kernel dispatches from the top again, so with the thread's autocast on
``torch.cov`` (it calls ``mm``) and ``F.affine_grid`` (``affine_grid_generator`` calls ``bmm``)
come back in bfloat16 though no list names them.

Found from torch's operator registry, not listed: each aten operator among the Python builtins
that has a composite kernel (one that only calls other ops) is traced once on meta tensors with
spellings' probe arguments. The trace runs a composite-explicit kernel itself, so the ops it
calls are seen too, and answers a question about values (``item()``, ``equal``) with a fixed
one, so a branch on data goes on. Two tables of resolve.py declare what no trace sees: a fused
kernel holds the op it is listed under (``FUSED``), and the recurrent kernels, never run on
made-up arguments, hold their cells' matrix products. An op no probe runs, or whose arguments
steer it to a path the probes did not take, is not found (docs/engines.md)."""

import functools

from hmp.binding import aten, spellings
from hmp.binding.resolve import FUSED, RNN_KERNELS
from hmp.core import torch_private

# what a value-dependent question gets while tracing on meta tensors: the trace goes on down one branch
_ANSWERS = {"_local_scalar_dense": 1, "equal": False, "is_nonzero": True}
# the ops a recurrent kernel holds on every device, by its cells' computation
_RNN_HOLDS = frozenset(("linear", "addmm", "mm", "matmul"))
# spellings' probe shapes and a stack of 2x3 matrices (an affine transform's theta)
_SHAPES = (*spellings.SHAPES, (2, 2, 3))
_BUDGET = 400  # ops one probe may dispatch: a kernel that loops per element (on made-up shapes) is cut short


class _Spent(Exception):
    """A probe dispatched its budget: what it reached so far is what it reaches."""


class _Reach(torch_private.DispatchMode):
    """Records every operator dispatched; runs composite-explicit kernels under itself."""

    def __init__(self):
        super().__init__()
        self.seen = set()
        self.inside = set()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.partition(".")[0]
        self.seen.add(name)
        self.count += 1
        if self.count > _BUDGET:
            raise _Spent
        if name in _ANSWERS:
            return _ANSWERS[name]
        key = torch_private.composite_kernel(func)
        if key is None or func in self.inside:  # a kernel of its own (or this one calling itself): run as it is
            return func(*args, **(kwargs or {}))
        self.inside.add(func)
        try:
            with self:
                return torch_private.run_kernel(func, key, args, kwargs or {})
        finally:
            self.inside.discard(func)


def _composite(packet):
    """True when some overload of ``packet`` only calls other ops."""
    for overload in packet.overloads():
        try:
            op = getattr(packet, overload)
            if torch_private.composite_implicit(op) or torch_private.composite_kernel(op) is not None:
                return True
        except Exception:  # an overload the registry names but cannot look up
            continue
    return False


def _traced(packet, builtin):
    """Every operator ``builtin`` (aten op ``packet``) dispatches over its probes: the first overload
    where a probe runs, its optional tensors left out and given; None if none runs."""
    seen = set()
    for overload in packet.overloads():
        try:
            schema = torch_private.schema_of(packet, overload)
        except Exception:
            continue
        sized = any(str(a.type) == "List[int]" and not getattr(a, "N", None) for a in schema.arguments)
        for shape in _SHAPES:
            # an int list a schema gives no length: 1, and one per dimension and one more (a size with a batch)
            trials = [
                spellings.probe_args(schema, shape, given, sizes)
                for sizes in ((1, len(shape) + 1) if sized else (1,))
                for given in (False, True)
            ]
            done = False
            for args in (a for a in trials if a is not None):
                mode = _Reach()
                try:
                    with mode:
                        builtin(*args)
                    done = True
                except _Spent:
                    done = True
                except Exception:
                    pass
                seen |= mode.seen
            if done:
                return seen
    return None


# kept: what torch's registry says each composite op reaches, traced once, never written by a call
@functools.lru_cache(maxsize=None)
def reached():
    """``{aten op name: frozenset of the operators it reaches}`` for every Python builtin of a composite
    operator a probe runs, with the declared tables' (the fused kernels, the recurrent kernels)."""
    found = {}
    with spellings.probing():
        for name, builtin in aten.python_builtins():
            packet = aten.aten_op(name)
            if name in RNN_KERNELS or packet is None or not _composite(packet):
                continue
            ops = _traced(packet, builtin)
            if ops is not None:
                found[name] = frozenset(ops - {name})
    for listed, fused in FUSED.items():
        for name in fused:
            found[name] = found.get(name, frozenset()) | {listed}
    for name in RNN_KERNELS:
        found[name] = _RNN_HOLDS
    return found


# kept: a memo of what torch's registry says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def acted_on(devices):
    """The aten op names torch.autocast acts on when on for ``devices``: its kernels' ops,
    and every op that reaches one of them."""
    kernels = frozenset().union(*(torch_private.autocast_kernels(d) for d in devices))
    return kernels | {name for name, ops in reached().items() if ops & kernels}
