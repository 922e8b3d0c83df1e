"""One timed run (a ``Sample``) and what the machine did while it ran.

What is timed: on a CPU, the wall clock between device synchronisations; on
a CUDA GPU, the device's own time between two events recorded on the
current stream around the run (``torch.cuda.Event``, read after the end
event is synchronised), so a host that is late to launch shows only where
the GPU waited for it; on another accelerator, the wall clock between its
``synchronize()`` calls.

What moves it, measured around the same run: how long this process's
threads were runnable but waiting for a CPU (the run-queue wait each
thread's ``/proc/self/task/*/schedstat`` counts, in ns), how long a
hypervisor ran other guests on this machine's CPUs (steal, ``/proc/stat``),
how many tasks were runnable then (``procs_running``) and this process's CPU
time. A thread that waited for a CPU for w seconds can lengthen the run by
at most w: ``Sample.contention`` is that wait over the run's wall time, the
share of it that other programs may have made. Steal is counted in 10 ms
ticks over all the machine's CPUs, too coarse for one run of a few ms: it
is judged over a comparison's runs together (timing.Load).

Why not CPU time as the measure, though other processes do not add to it
directly: on a 2-core machine at load 4, a training step's CPU time moved
with the load too. With torch's 2 threads, 5.7x (threads spin at a
barrier while the other waits for a CPU, and the spinning is CPU time);
with 1 thread, 1.7x (caches refilled after every switch). No clock here is
immune to a busy machine; hmp tells a run that another program delayed from
one it did not, and judges only the latter (timing.ratio). Where the host
does not report its threads' waits (not Linux), the tasks runnable against
the CPUs are all it has: more runnable than CPUs, and nothing is judged.

``Host`` takes its readers as parameters, so tests replay a machine (a
scripted clock, scripted waits) without reading this one.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Callable, NamedTuple

import torch

NS = 1e-9
_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01  # /proc/stat's unit


class Sample(NamedTuple):
    """One timed run: ``seconds`` (the measure: the wall clock, or a GPU's events), ``wall``, and what
    the machine did meanwhile: ``waited`` (this process's threads' run-queue wait, summed; None where
    the host does not report it), ``stolen`` (steal over the machine's CPUs, summed), ``runnable``
    (tasks runnable on the machine at its end, this thread included), ``cpu`` (this process's CPU
    seconds), ``threads`` (torch's intra-op threads) and ``cpus`` (those this process may run on)."""

    seconds: float
    wall: float
    waited: float | None = None
    stolen: float | None = None
    runnable: int | None = None
    cpu: float | None = None
    threads: int | None = None
    cpus: int = 1

    def contention(self):
        """Its threads' waits for a CPU over the run's wall time: an upper bound on the share of the run
        that other programs made (None: not known). A part of the run (an op's calls in it) is judged by
        the run's share: the time lost falls on the run's parts as the time does."""
        if self.waited is None:
            return None
        return self.waited / self.wall if self.wall > 0 else float("inf")


def _schedstat_waits():
    """Seconds this process's threads have waited on a run queue, summed (None: not reported here)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, read = 0, False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
                read = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total * NS if read else None


def _proc_stat():
    """``(steal seconds over all CPUs, tasks runnable now)`` from /proc/stat; without it (not Linux), no
    steal and the 1-minute load average, rounded up, for the tasks runnable (None: not even that)."""
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        try:
            return None, math.ceil(os.getloadavg()[0])
        except (AttributeError, OSError):
            return None, None
    steal = runnable = None
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = line.split()
            steal = int(fields[8]) * _TICK if len(fields) > 8 else 0.0
        elif line.startswith("procs_running "):
            runnable = int(line.split()[1])
    return steal, runnable


def cpus():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Reading(NamedTuple):
    wall: float
    cpu: float
    waited: float | None
    stolen: float | None
    runnable: int | None


class Host:
    """The machine's counters, each reader a parameter (this machine's by default)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        waits: Callable[[], float | None] = _schedstat_waits,
        machine: Callable[[], tuple] = _proc_stat,
        cpus: Callable[[], int] = cpus,
        threads: Callable[[], int] = torch.get_num_threads,
    ):
        self.clock, self.cpu_clock, self.waits, self.machine = clock, cpu_clock, waits, machine
        self.cpus, self.threads = cpus, threads

    def read(self):
        steal, runnable = self.machine()
        return Reading(self.clock(), self.cpu_clock(), self.waits(), steal, runnable)

    def sample(self, before, after, seconds=None):
        """The Sample between two readings (``seconds``: the measure, when not the wall clock)."""
        wall = after.wall - before.wall
        waited = None if before.waited is None or after.waited is None else max(0.0, after.waited - before.waited)
        stolen = None if before.stolen is None or after.stolen is None else max(0.0, after.stolen - before.stolen)
        return Sample(
            wall if seconds is None else seconds,
            wall,
            waited,
            stolen,
            after.runnable,
            after.cpu - before.cpu,
            self.threads(),
            self.cpus(),
        )


HOST = Host()
_IN_USE = [HOST]  # the host measure() reads when given none: on() replays another machine for a block


@contextlib.contextmanager
def on(host):
    """Measure on ``host`` (a Host with readers of its own: a replayed machine) for the block."""
    _IN_USE.append(host)
    try:
        yield host
    finally:
        _IN_USE.remove(host)


def quiet():
    """A Host with this machine's clocks whose counters say nothing else ran (no waits, no steal): what a
    test of a tool's logic measures on when the logic, not this machine's load, is under test."""
    return Host(waits=lambda: 0.0, machine=lambda: (0.0, 1))


def _cuda_events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def device_of(modules):
    """The device the first parameter of ``modules`` lives on (``cpu`` without one): where their step runs."""
    for module in modules:
        for parameter in module.parameters():
            return parameter.device.type
    return "cpu"


def synchronizer(device):
    """The device's synchronize (None for a CPU, where a run has ended when it returns)."""
    kind = str(device).split(":")[0]
    if kind == "cpu":
        return None
    return getattr(getattr(torch, kind, None), "synchronize", None)


def measure(fn, device="cpu", host=None, calls=1):
    """Run ``fn()`` ``calls`` times back to back and return its Sample per call: queued work drained
    before (``synchronizer``), the device's time on CUDA (events around the calls), the wall clock
    between synchronisations elsewhere, and the host's counters around it all."""
    host = host or _IN_USE[-1]
    kind = str(device).split(":")[0]
    sync = synchronizer(device)
    if sync is not None:
        sync()
    events = _cuda_events() if kind == "cuda" else None
    before = host.read()
    if events is not None:
        events[0].record()
    for _ in range(calls):
        fn()
    if events is not None:
        events[1].record()
        events[1].synchronize()
    elif sync is not None:
        sync()
    after = host.read()
    seconds = events[0].elapsed_time(events[1]) / 1e3 if events is not None else None
    sample = host.sample(before, after, seconds)
    if calls == 1:
        return sample
    per = {k: getattr(sample, k) for k in ("seconds", "wall", "waited", "stolen")}
    return sample._replace(**{k: None if v is None else v / calls for k, v in per.items()})


def timed(fn, device="cpu", host=None):
    """``(fn(), its Sample)``: one call measured as measure() measures it, its value kept."""
    got = []
    sample = measure(lambda: got.append(fn()), device, host)
    return got[0], sample
