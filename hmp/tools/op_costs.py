"""What ops cost. ``measure``: what each op still computing in float32
costs in a step, and which ops compute in float32 because the model's
author asked for it; hmp.tune picks the ops it tries in bf16 from these.
``op_times``: each listed op's time in fp32 and under the lists, for
hmp.audit's rows.

Times: every top-level torch call that takes float32 tensors and returns
floating ones, per op name (hmp's own wrappers run their op with torch
functions off, so what a listed op calls inside is not seen). A step is
timed ``runs`` times after a warm-up, with Python's garbage collector
paused; each call is the median of its times over the runs (a step calls
the same ops in the same order), so a stall that lands on one run's call
(a collection, a thread waking, a page fault) does not make that op look
expensive; an op's time is at most its median total over the runs, so it
is never more than the step those runs took (Costs.step_seconds).

The author's float32: ``x.float()``, ``x.to(torch.float32)`` (also when x
is float32 already, as in an fp32 run: the author wrote it for the lower
dtype's sake) and an op given ``dtype=torch.float32`` mark what they return.
Inside the module (the innermost hooked one) where the mark was made, an op
that takes a marked tensor computes in float32 on purpose, and its floating
outputs are marked too: LlamaRMSNorm's ``pow``, ``mean``, ``rsqrt``, ``mul``
after ``hidden_states.to(torch.float32)``. A conversion to another dtype
returns an unmarked tensor, and a value leaving the module leaves its
mark behind (the residual stream that the norm's input came from is not
the author's float32).
"""

from __future__ import annotations

import statistics
import time
import weakref

import torch
from torch.overrides import TorchFunctionMode

from hmp.core.switches import casts_enabled
from hmp.core.torch_private import tree_leaves
from hmp.tools import host as host_mod
from hmp.tools import timing
from hmp.tools.record import ThreadModules, module_paths
from hmp.tools.timing import collector_paused

# calls a step makes that are not math to run in another dtype (indexing only moves values: in the
# BF16 list it would only round them)
NOT_CANDIDATES = frozenset(
    (
        "backward",
        "to",
        "type",
        "float",
        "double",
        "half",
        "bfloat16",
        "detach",
        "clone",
        "copy_",
        "item",
        "tolist",
        "numpy",
        "contiguous",
        "view",
        "reshape",
        "size",
        "dim",
        "getitem",
    )
)
# conversions that ask for float32 by name: Tensor.float(), Tensor.to(..., torch.float32), Tensor.type(torch.float32)
TO_FLOAT32 = frozenset(("float", "to", "type"))


def _tensors(value):
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _asks_float32(name, args, kwargs):
    """The call asks for float32 by name: ``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32``."""
    if kwargs.get("dtype") is torch.float32:
        return True
    if name == "float":
        return True
    return name in TO_FLOAT32 and any(a is torch.float32 for a in args[1:])


def op_name(func):
    """The list name of a torch function as a TorchFunctionMode sees it: ``__rmul__`` is ``mul``."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in ("add", "sub", "mul", "matmul", "truediv", "pow", "div"):
            name = name[1:]
    return name


class OpCosts(TorchFunctionMode):
    """One run's calls: ``calls``, ``[(op, seconds)]`` in call order, of the
    ops that compute in float32; ``authored``, the ops that took a tensor the
    author computes in float32 (see the module's docstring). ``paths``:
    ``{module path: module}`` whose calls scope the marks."""

    def __init__(self, paths):
        super().__init__()
        self.paths, self.calls, self.authored = paths, [], set()
        self._marks = {}  # id(tensor) -> (weakref, module path)
        self._tls = ThreadModules()
        self._handles = []

    # -- the module a call runs in -------------------------------------------------------------------

    def _stack(self):
        return self._tls.modules

    def __enter__(self):
        for path, module in self.paths.items():
            self._handles.append(module.register_forward_pre_hook(lambda m, a, p=path: self._stack().append(p)))
            self._handles.append(module.register_forward_hook(lambda m, a, o, p=path: self._leave(p)))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _leave(self, path):
        stack = self._stack()
        if path in stack:
            del stack[len(stack) - 1 - stack[::-1].index(path) :]

    # -- the author's float32 ------------------------------------------------------------------------

    def _marked(self, tensors, module):
        for t in tensors:
            mark = self._marks.get(id(t))
            if mark is not None and mark[0]() is t and mark[1] == module:
                return True
        return False

    def _mark(self, tensors, module):
        for t in tensors:
            if t.is_floating_point():
                self._marks[id(t)] = (weakref.ref(t), module)

    # -- every call ----------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        if not casts_enabled():  # the optimizer step under disable_casts(), not the model
            return out
        name = op_name(func)
        stack = self._stack()
        module = stack[-1] if stack else None
        inputs = _tensors((args, kwargs))
        if _asks_float32(name, args, kwargs):
            self._mark(_tensors(out), module)
            if name not in TO_FLOAT32:
                self.authored.add(name)
        elif name not in NOT_CANDIDATES and self._marked(inputs, module):
            self.authored.add(name)
            self._mark(_tensors(out), module)
        if name in NOT_CANDIDATES or (name.endswith("_") and not name.endswith("__")):
            return out
        if any(t.dtype == torch.float32 for t in inputs) and any(t.is_floating_point() for t in _tensors(out)):
            self.calls.append((name, elapsed))
        return out


class Costs:
    """What ``measure()`` found: ``seconds`` (op -> its float32 time in a
    step, the sum of its calls' medians), ``authored`` (the ops the author
    computes in float32), ``runs`` (how many timed runs), ``step_seconds``
    (the median wall time of those same runs, each whole step: what an op's
    time is a part of, never a step timed elsewhere or in another
    configuration)."""

    def __init__(self, seconds, authored, runs, step_seconds=None):
        self.seconds, self.authored, self.runs = seconds, authored, runs
        self.step_seconds = step_seconds

    def of_step(self, op):
        """``op``'s time as a share of the step it was measured in (None when the step was not timed)."""
        if not self.step_seconds:
            return None
        return self.seconds.get(op, 0.0) / self.step_seconds

    def share(self, op):
        total = sum(self.seconds.values())
        return self.seconds.get(op, 0.0) / total if total else 0.0


def measure(run, modules, runs=3):
    """Costs of the ops ``run()`` calls (one step from the same state each
    time, under the conversion to measure): one warm-up run, then ``runs``
    timed ones with the garbage collector paused; a call's time is its
    median over the runs. ``modules``: the objects whose modules scope the
    author's float32 (module_paths)."""
    paths = module_paths(modules)
    with OpCosts(paths):
        run()  # warm-up: first calls allocate, fill caches and compile kernels
    timed, walls = [], []
    with collector_paused():
        for _ in range(runs):
            costs = OpCosts(paths)
            start = time.perf_counter()
            with costs:
                run()
            walls.append(time.perf_counter() - start)
            timed.append(costs)
    authored = set().union(*(c.authored for c in timed))
    seconds = {}
    orders = [[name for name, _ in c.calls] for c in timed]
    totals = {
        name: statistics.median(sum(s for n, s in c.calls if n == name) for c in timed) for name in set().union(*orders)
    }  # each op's median total over the runs: never more than the median step (each run's is inside it)
    if all(order == orders[0] for order in orders):
        for i, name in enumerate(orders[0]):
            seconds[name] = seconds.get(name, 0.0) + statistics.median(c.calls[i][1] for c in timed)
        # a sum of medians can exceed the median of the sums (stalls on different calls in different
        # runs): no more than the op's median total, so no op is said to take longer than the step
        seconds = {name: min(value, totals[name]) for name, value in seconds.items()}
    else:  # the runs called different ops (data-dependent control flow): each op's median total
        seconds = totals
    return Costs(seconds, authored, runs, statistics.median(walls))


NOT_TIMED = {"fp32_ms": None, "lists_ms": None, "cast_ms": None, "time_ratio": None}
TIMED_PAIRS = 5  # an fp32 run and a run under the lists, this many times, interleaved, after one of each
AGAIN = "lists again"  # the control arm: the lists timed a second time


def op_times(stats_of, repeats=TIMED_PAIRS, walls=None, device="cpu", host=None):
    """``({op: {"fp32_ms", "lists_ms", "cast_ms", "time_ratio"}}, total)``:
    the wall time of each recorded op's calls in a step in fp32
    (``stats_of(True)``: a recorded run casting nothing, its
    record.OpStats by op) and under the lists (``stats_of(False)``), the
    latter with the casts hmp makes for them (``cast_ms`` of it): medians
    of ``repeats`` runs each, in adjacent pairs (timing.paired), after a warm-up run of each and
    with Python's garbage collector paused, and the time under the lists
    relative to fp32 (timing.ratio), for the ops recorded in every run on
    both sides (both_sides()); ``total``: that ratio for those same ops'
    time together, from the same runs (total_ratio()), with the lists timed
    a second time in the same rounds as its control. Each run is a
    host.Sample: a pair in which other programs took more than the margin
    of a run's time is left out. Both runs go through the recording wrappers, so the same
    calls are timed under the names the rows have: a TorchFunctionMode is
    handed ``Tensor.div`` for ``/`` and cannot tell ``truediv`` from
    ``div``. None: not run in that step. ``walls``: a dict given gets each
    side's median wall time of those same runs in ms (``{"fp32", "lists"}``):
    the steps the ops' times are parts of, never less than any op's (a
    run's op time is inside its wall time, so their medians keep the order). ``host``: the machine's
    counters (host.Host; this machine's by default)."""
    on = host

    def sample(fp32):
        stats, taken = host_mod.timed(lambda: stats_of(fp32), device, on)
        return taken, stats

    # adjacent pairs in alternating order after a warm-up pair (first calls fill caches): timing.paired
    samplers = {"fp32": lambda: sample(True), "lists": lambda: sample(False), AGAIN: lambda: sample(False)}
    with collector_paused():
        got = timing.paired(samplers, "fp32", repeats, warmup=1)
    runs = {"fp32": got.reference, "lists": got.samples("lists"), AGAIN: got.samples(AGAIN)}
    if walls is not None:
        walls.update({kind: statistics.median(s.seconds for s, _ in runs[kind]) * 1e3 for kind in ("fp32", "lists")})

    def ms(kind, name, part):
        return [s._replace(seconds=part(stats[name]) * 1e3) for s, stats in runs[kind] if name in stats] or None

    def median(taken):
        return taken and statistics.median(s.seconds for s in taken)

    out, common = {}, both_sides(runs)
    for name in set().union(*(stats for kind in ("fp32", "lists") for _, stats in runs[kind])):
        a = ms("fp32", name, lambda s: s.op_seconds)
        b = ms("lists", name, lambda s: s.op_seconds + s.cast_seconds)
        out[name] = {
            "fp32_ms": median(a),
            "lists_ms": median(b),
            "cast_ms": median(ms("lists", name, lambda s: s.cast_seconds)),
            "time_ratio": timing.ratio(a, b) if name in common else None,
        }
    return out, total_ratio(runs)


def both_sides(runs):
    """The ops recorded in every run on both sides: the op set a total is taken over. An op recorded on one
    side only (an op in no list that hmp wraps under the lists and the fp32 run does not record) has no
    fp32 time to set against its time under the lists, and its row says not timed."""
    every = [set(stats) for kind in runs for _, stats in runs[kind]]
    return set.intersection(*every) if every else set()


def total_ratio(runs):
    """The listed ops' time under the lists relative to fp32, from the same runs as the rows' times and over
    the same ops (both_sides(): those whose rows have a ratio), pair by pair: the audit's headline; its
    control, the lists' second arm against the first (``runs`` without it: no control)."""
    ops = both_sides(runs)
    if not ops:
        return None
    totals = {
        kind: [s._replace(seconds=sum(stats[op].op_seconds + _cast(kind, stats[op]) for op in ops)) for s, stats in got]
        for kind, got in runs.items()
    }
    control = timing.ratio(totals["lists"], totals[AGAIN], timed="the lists") if AGAIN in totals else None
    return timing.ratio(totals["fp32"], totals["lists"], control=control)


def _cast(kind, stats):
    """The casts hmp makes count under the lists, as in the rows' ``lists_ms``; the fp32 runs make none."""
    return stats.cast_seconds if kind != "fp32" else 0.0
