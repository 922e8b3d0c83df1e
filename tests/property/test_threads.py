"""Threads: each thread sees its own disable_casts state; convert()/revert()
from one thread while others run ops never crashes or deadlocks.

What a concurrent op sees during a switch: convert() and revert() hold
``runtime.lock`` (so two of them never interleave), and each namespace entry
is swapped with a single setattr, so an op finds either the original or a
complete wrapper, never a half-built one. A forward pass that spans a switch
can run some ops converted and some not; when that mixes bf16 outputs with
fp32 weights in an op that requires one dtype, torch raises its dtype
mismatch error. The switching test allows exactly that error and nothing
else; the fixed-configuration test asserts exact dtypes.
"""

import contextlib
import random
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, snapshot
from helpers.models import LinearNormLinear

import hmp
from hmp.diagnostics import errors

BF16, FP32 = torch.bfloat16, torch.float32
THREADS = 8
JOIN_S = 120
SWITCHES = 30  # per switcher: two of them convert and revert 60 times among the workers' steps


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def mixed_dtypes(e):
    """torch's error for a forward that ran some ops under one configuration
    and some under another (bf16 with fp32, or bf16 with fp16)."""
    msg = str(e)
    return errors.is_mismatch(e) or ("BFloat16" in msg and "Half" in msg)


def start(workers):
    threads = [threading.Thread(target=w, daemon=True) for w in workers]
    for t in threads:
        t.start()
    return threads


def join(threads):
    for t in threads:
        t.join(JOIN_S)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"deadlock or hang: {stuck}"


@pytest.fixture
def fast_switching():
    """Switch threads as often as Python allows, to widen every race window."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_eight_threads_each_see_their_own_state(fast_switching):
    hmp.convert()
    torch.manual_seed(0)
    shared = LinearNormLinear()  # read by every thread: the shared weight cache must stay right
    probe = torch.randn(4, 8)
    with torch.no_grad():
        reference = {0: shared(probe)}
        with hmp.disable_casts():
            reference[1] = shared(probe)
    barrier = threading.Barrier(THREADS)
    failures, counts = [], []

    def worker(seed):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        model = LinearNormLinear()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        done = 0
        try:
            barrier.wait(JOIN_S)
            for _ in range(25):
                depth = rng.randrange(4)
                with contextlib.ExitStack() as stack:
                    for _ in range(depth):
                        stack.enter_context(hmp.disable_casts())
                    assert hmp.casts_enabled() == (depth == 0)
                    out = model(x)
                    assert out.dtype == (BF16 if depth == 0 else FP32)
                    assert F.softmax(out, -1).dtype == FP32  # FP32 list
                    loss = F.mse_loss(out.float(), y)
                    opt.zero_grad()
                    loss.backward()
                    if rng.random() < 0.5 and depth:  # leave one block early, mid-step
                        stack.close()
                        depth = 0
                    assert hmp.casts_enabled() == (depth == 0)
                with hmp.disable_casts():
                    opt.step()
                assert hmp.casts_enabled()
                for p in model.parameters():
                    assert p.dtype == FP32 and p.grad.dtype == FP32
                    assert opt.state[p]["momentum_buffer"].dtype == FP32
                d = rng.randrange(2)
                with torch.no_grad(), hmp.disable_casts() if d else contextlib.nullcontext():
                    assert torch.equal(shared(probe), reference[d])
                done += 1
        except Exception as e:  # reported by the main thread
            failures.append(f"thread {seed}: {type(e).__name__}: {e}")
        counts.append(done)

    join(start([lambda s=s: worker(s) for s in range(THREADS)]))
    assert not failures, failures
    assert counts == [25] * THREADS


@pytest.mark.slow  # about 5 s quiet; a minute on a busy 2-core CI machine
@pytest.mark.torch_internals
def test_convert_and_revert_while_eight_threads_run(fast_switching, pristine):
    stop = threading.Event()
    failures, mismatches, steps = [], [], []
    configs = [dict(), dict(opt_level="O2"), dict(low_precision_type=torch.float16), dict(cache=False)]

    def worker(seed):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        model = LinearNormLinear()
        x = torch.randn(16, 8)
        n = 0
        try:
            while not stop.is_set():
                depth = rng.randrange(3)
                with contextlib.ExitStack() as stack:
                    for _ in range(depth):
                        stack.enter_context(hmp.disable_casts())
                    assert hmp.casts_enabled() == (depth == 0)  # never disturbed by a switch
                    try:
                        out = model(x)
                    except RuntimeError as e:
                        if not mixed_dtypes(e) or depth:
                            raise
                        mismatches.append(str(e).splitlines()[0])  # a forward that spanned a switch
                        continue
                    if depth:  # nothing is ever cast in a disabled thread
                        assert out.dtype == FP32
                    else:
                        assert out.dtype in (BF16, torch.float16, FP32)
                    out.float().sum().backward()
                    for p in model.parameters():
                        assert p.dtype == FP32 and p.grad.dtype == FP32
                        p.grad = None
                    assert hmp.casts_enabled() == (depth == 0)
                n += 1
        except Exception as e:
            failures.append(f"thread {seed}: {type(e).__name__}: {e}")
        steps.append(n)

    def switcher(seed, rounds):
        rng = random.Random(seed)
        try:
            for _ in range(rounds):
                if rng.random() < 0.7:
                    hmp.convert(**rng.choice(configs))
                    lists = hmp.effective_lists()  # one whole configuration, never a mix
                    assert not lists["bf16"] or "linear" in lists["bf16"]
                else:
                    hmp.revert()
        except Exception as e:
            failures.append(f"switcher {seed}: {type(e).__name__}: {e}")

    threads = start([lambda s=s: worker(s) for s in range(THREADS)])
    # two switchers contend for the lock
    switchers = start([lambda: switcher(100, SWITCHES), lambda: switcher(101, SWITCHES)])
    join(switchers)
    stop.set()
    join(threads)
    assert not failures, failures[:5]
    assert min(steps) > 0, steps

    # after the switching stops, everything is consistent
    hmp.convert()
    model, x = LinearNormLinear(), torch.randn(4, 8)
    assert model(x).dtype == BF16
    with hmp.disable_casts():
        assert model(x).dtype == FP32
    seen = []
    t = threading.Thread(target=lambda: seen.append((hmp.casts_enabled(), model(x).dtype)))
    t.start()
    t.join(JOIN_S)
    assert seen == [(True, BF16)]
    hmp.revert()
    assert model(x).dtype == FP32
    assert_same(pristine, snapshot())
    print(
        f"threads: {THREADS} workers, 2 switchers x {SWITCHES} switches, {sum(steps)} forward/backward steps, "
        f"{len(mismatches)} forwards spanned a switch"
    )


def test_leaving_disable_casts_while_another_thread_reverts(fast_switching):
    """The outermost disable_casts() exit calls the cache hook that revert()
    clears: the exit must never call a hook that vanished in between."""
    stop = threading.Event()
    failures = []

    def leaver():
        try:
            while not stop.is_set():
                for _ in range(200):
                    with hmp.disable_casts():
                        pass
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    threads = start([leaver for _ in range(4)])
    for _ in range(20):  # each revert() a race with four threads' exits
        hmp.convert()
        hmp.revert()
    stop.set()
    join(threads)
    assert not failures, failures[:3]


def test_regions_open_and_backward_passes_release_in_many_threads_at_once(fast_switching):
    """Every thread's no-grad stores are in one process-wide set, which a
    backward pass in any thread reads while other threads open regions and
    frozen_weights() blocks: the reader must never see the set change under
    it (a weakref.WeakSet raised "Set changed size during iteration")."""
    hmp.convert()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        reference = model(x)
    stop, failures = threading.Event(), []

    def holder():  # many live stores make each read of the set long
        with hmp.frozen_weights():
            stop.wait(JOIN_S)

    def guarded(step):
        def run():
            try:
                for _ in range(2000):
                    step()
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")

        return run

    def infer():
        with torch.no_grad():
            assert torch.equal(model(x), reference)

    def train():
        model(x).sum().backward()

    holders = start([holder for _ in range(200)])
    try:
        join(start([guarded(infer), guarded(infer), guarded(train), guarded(train)]))
    finally:
        stop.set()
    join(holders)
    assert not failures, failures[:3]


def test_the_shared_weak_set_keeps_what_lives_and_hands_it_over_once():
    from hmp.core.state import SharedWeakSet

    class Kept:
        pass

    s = SharedWeakSet()
    objs = [Kept() for _ in range(5)]
    for o in objs:
        s.add(o)
    del objs[1], objs[2]  # two of them go
    assert len(s) == 3 and sorted(map(id, s.alive())) == sorted(map(id, objs))
    assert sorted(map(id, s.take())) == sorted(map(id, objs))
    assert not s and s.alive() == [] and s.take() == []
