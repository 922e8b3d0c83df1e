"""disable_casts() and enable_casts(): nesting, decorators (on functions, generator,
coroutine and async generator functions), exceptions, threads, and the outermost op deciding."""

import asyncio
import contextlib
import inspect
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp

BF16, FP32 = torch.bfloat16, torch.float32


def test_disable_casts_nesting_and_decorator():
    hmp.convert()
    x = torch.randn(2, 2)
    with hmp.disable_casts():
        with hmp.disable_casts():
            assert not hmp.casts_enabled()
        assert not hmp.casts_enabled()  # the outer block is still disabled
        assert torch.mm(x, x).dtype == FP32
    assert hmp.casts_enabled() and torch.mm(x, x).dtype == BF16

    @hmp.disable_casts()
    def step():
        return torch.mm(x, x).dtype

    assert step() == FP32 and torch.mm(x, x).dtype == BF16


def test_disable_casts_exception_safe():
    hmp.convert()
    with pytest.raises(KeyError):
        with hmp.disable_casts():
            raise KeyError("boom")
    assert hmp.casts_enabled()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


def test_exception_inside_wrapped_op_leaves_state_correct():
    hmp.convert()
    with pytest.raises(RuntimeError):
        torch.mm(torch.ones(2, 3), torch.ones(2, 3))  # shape mismatch inside the op
    assert hmp.casts_enabled()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16


def test_disable_casts_is_thread_local():
    hmp.convert()
    x = torch.ones(4, 4)
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def other():
        entered.wait(10)
        seen["enabled"] = hmp.casts_enabled()
        seen["dtype"] = torch.mm(x, x).dtype
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with hmp.disable_casts():
        entered.set()
        checked.wait(10)
        assert torch.mm(x, x).dtype == FP32
    t.join(10)
    assert seen == {"enabled": True, "dtype": BF16}


def test_enable_casts_inside_disable_casts():
    hmp.convert()
    x = torch.ones(2, 2)
    with hmp.disable_casts():
        with hmp.disable_casts():
            with hmp.enable_casts():
                assert hmp.casts_enabled() and torch.mm(x, x).dtype == BF16
                with hmp.disable_casts():  # nests either way
                    assert torch.mm(x, x).dtype == FP32
                assert torch.mm(x, x).dtype == BF16
            assert not hmp.casts_enabled()
        with pytest.raises(KeyError):
            with hmp.enable_casts():
                raise KeyError("boom")
        assert not hmp.casts_enabled()  # restored on the exception path too
    assert hmp.casts_enabled()


def test_enable_casts_as_a_decorator_in_two_threads():
    """Each call gets its own block: threads never share one saved state."""
    hmp.convert()
    x = torch.ones(2, 2)
    inside, release = threading.Barrier(2), threading.Event()

    @hmp.enable_casts()
    def step():
        inside.wait(10)
        release.wait(10)
        return torch.mm(x, x).dtype

    out = []

    def worker():
        with hmp.disable_casts():
            out.append((step(), hmp.casts_enabled()))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert out == [(BF16, False), (BF16, False)]
    # one instance entered nested: each entry puts back what it found
    block = hmp.enable_casts()
    with hmp.disable_casts():
        with block:
            assert hmp.casts_enabled()
            with hmp.disable_casts():
                with block:
                    assert hmp.casts_enabled()
                assert not hmp.casts_enabled()
            assert hmp.casts_enabled()
        assert not hmp.casts_enabled()
    assert hmp.casts_enabled()


def test_new_thread_starts_enabled_while_parent_disabled():
    hmp.convert()
    out = []
    with hmp.disable_casts():
        t = threading.Thread(target=lambda: out.append(torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype))
        t.start()
        t.join(10)
    assert out == [BF16]


def test_outermost_op_decides():
    hmp.convert()
    x = torch.randn(3) + 3
    # __rtruediv__ (FP32 list) is implemented with mul (BF16 list): not cast again
    y = 2 / x
    assert y.dtype == FP32
    with hmp.disable_casts():
        assert torch.equal(y, 2 / x)  # the inner mul ran in fp32 too


def _mm_dtype():
    x = torch.ones(2, 2)
    return torch.mm(x, x).dtype


def test_generator_decorator_covers_each_resumption_of_the_body():
    """The body runs uncast at every step; the caller's code between two
    next() calls casts; the wrapper is still a generator function."""

    @hmp.disable_casts()
    def gen(n):
        """Doc."""
        for _ in range(n):
            yield _mm_dtype(), hmp.casts_enabled()

    assert inspect.isgeneratorfunction(gen)
    assert gen.__name__ == "gen" and gen.__doc__ == "Doc." and inspect.isgeneratorfunction(gen.__wrapped__)
    with hmp.converted():
        it = gen(3)
        assert _mm_dtype() == BF16  # creating the generator switches nothing
        for _ in range(3):
            assert next(it) == (FP32, False)
            assert hmp.casts_enabled() and _mm_dtype() == BF16  # between resumptions
        with pytest.raises(StopIteration):
            next(it)
        assert hmp.casts_enabled()
        assert list(gen(2)) == [(FP32, False)] * 2


def test_generator_decorator_send_throw_close_return_and_yield_from():
    seen = []

    @hmp.disable_casts()
    def echo():
        try:
            got = yield "ready"
            while got != "stop":
                try:
                    got = yield (got, _mm_dtype())
                except KeyError as e:
                    got = yield ("caught", e.args[0], _mm_dtype())
            return "returned"
        finally:
            seen.append(("finally", hmp.casts_enabled()))

    with hmp.converted():
        it = echo()
        assert next(it) == "ready"
        assert it.send("a") == ("a", FP32)
        assert it.throw(KeyError("k")) == ("caught", "k", FP32)
        assert _mm_dtype() == BF16
        with pytest.raises(StopIteration) as stop:
            it.send("stop")
        assert stop.value.value == "returned" and seen == [("finally", False)]

        it = echo()
        next(it)
        it.close()  # GeneratorExit reaches the body, which runs uncast
        assert seen[-1] == ("finally", False) and hmp.casts_enabled()
        it.close()  # closed twice, or never started: nothing runs
        echo().close()
        assert len(seen) == 2

        def outer():  # delegation passes send, throw and the return value through
            result = yield from echo()
            yield result

        it = outer()
        assert next(it) == "ready"
        assert it.send("b") == ("b", FP32)
        assert it.throw(KeyError("j")) == ("caught", "j", FP32)
        assert it.send("stop") == "returned" and _mm_dtype() == BF16


def test_exception_escaping_a_decorated_generator_restores_state():
    @hmp.disable_casts()
    def fails(at_start):
        if at_start:
            raise ValueError("start")
        yield _mm_dtype()
        raise ValueError("later")

    @hmp.disable_casts()
    def ignores_close_once():
        try:
            yield
        except GeneratorExit:
            pass
        yield "ignored"

    with hmp.converted():
        with pytest.raises(ValueError, match="start"):
            next(fails(True))
        assert hmp.casts_enabled()
        it = fails(False)
        assert next(it) == FP32
        with pytest.raises(ValueError, match="later"):
            next(it)
        assert hmp.casts_enabled() and _mm_dtype() == BF16
        it = fails(False)
        next(it)
        with pytest.raises(KeyError):
            it.throw(KeyError("in"))  # not caught by the body: escapes, state back
        assert hmp.casts_enabled()
        it = ignores_close_once()
        next(it)
        with pytest.raises(RuntimeError, match="ignored GeneratorExit"):
            it.close()  # as for the undecorated generator
        assert hmp.casts_enabled()
        it.close()  # at its second yield: GeneratorExit ends it
        assert it.gi_frame is None and hmp.casts_enabled()


@pytest.mark.parametrize("order", ["no_grad above", "no_grad below"])
def test_generator_decorator_stacked_with_no_grad(order):
    a = torch.ones(2, 2, requires_grad=True)

    def body():
        x = a
        for _ in range(2):
            x = torch.mm(x, a)
            yield x.dtype, x.requires_grad, torch.is_grad_enabled()

    if order == "no_grad above":
        gen = torch.no_grad()(hmp.disable_casts()(body))
    else:
        gen = hmp.disable_casts()(torch.no_grad()(body))
    assert inspect.isgeneratorfunction(gen)
    with hmp.converted():
        it = gen()
        assert next(it) == (FP32, False, False)  # no graph recorded inside
        y = torch.mm(a, a)
        assert torch.is_grad_enabled() and y.requires_grad and y.dtype == BF16
        assert next(it) == (FP32, False, False)


def test_interleaved_generators_each_keep_their_own_switch():
    @hmp.disable_casts()
    def off():
        while True:
            yield _mm_dtype()

    @hmp.enable_casts()
    def on():
        while True:
            yield _mm_dtype()

    with hmp.converted():
        a, b = off(), on()
        assert (next(a), next(b), next(a), _mm_dtype(), next(b)) == (FP32, BF16, FP32, BF16, BF16)
        with hmp.disable_casts():
            assert (next(b), _mm_dtype(), next(a), next(b), _mm_dtype()) == (BF16, FP32, FP32, BF16, FP32)
        a.close()
        b.close()
        assert hmp.casts_enabled()


@settings(deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=4), st.lists(st.integers(0, 3), max_size=12), st.booleans())
def test_any_interleaving_of_decorated_generators(kinds, schedule, caller_on):
    """Each generator sees its own switch at every step, whatever ran between,
    and the caller's state is untouched."""

    def make(on):
        @(hmp.enable_casts() if on else hmp.disable_casts())
        def gen():
            while True:
                yield hmp.casts_enabled()

        return gen()

    with hmp.converted():
        with contextlib.nullcontext() if caller_on else hmp.disable_casts():
            gens = [make(on) for on in kinds]
            for i in schedule:
                i %= len(gens)
                assert next(gens[i]) is kinds[i]
                assert hmp.casts_enabled() is caller_on
            for g in gens:
                g.close()
            assert hmp.casts_enabled() is caller_on
    assert hmp.casts_enabled()


def test_coroutine_decorator_switches_only_while_its_own_code_runs():
    """asyncio runs other tasks in this thread during an await: they must
    keep casting while a @disable_casts() coroutine is suspended."""
    log = []

    @hmp.disable_casts()
    async def uncast(waiting, done):
        """Doc."""
        log.append(("uncast", _mm_dtype()))
        waiting.set()
        await done.wait()  # the other task runs here
        log.append(("uncast", _mm_dtype()))
        return "result"

    async def other(waiting, done):
        await waiting.wait()
        log.append(("other", _mm_dtype(), hmp.casts_enabled()))
        done.set()

    async def main():
        waiting, done = asyncio.Event(), asyncio.Event()
        results = await asyncio.gather(uncast(waiting, done), other(waiting, done))
        log.append(("main", _mm_dtype()))
        return results

    assert inspect.iscoroutinefunction(uncast) and uncast.__name__ == "uncast" and uncast.__doc__ == "Doc."
    with hmp.converted():
        assert asyncio.run(main()) == ["result", None]
        assert log == [("uncast", FP32), ("other", BF16, True), ("uncast", FP32), ("main", BF16)]


def test_coroutine_decorator_exceptions_and_cancellation():
    @hmp.enable_casts()
    async def fails():
        await asyncio.sleep(0)
        assert _mm_dtype() == BF16
        raise KeyError("boom")

    @hmp.disable_casts()
    async def sleeps(seen):
        try:
            await asyncio.sleep(10)
        finally:
            seen.append(_mm_dtype())  # the CancelledError is thrown into the body, uncast

    async def main():
        with hmp.disable_casts():
            with pytest.raises(KeyError):
                await fails()
            assert not hmp.casts_enabled()
        seen = []
        task = asyncio.ensure_future(sleeps(seen))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen, hmp.casts_enabled()

    with hmp.converted():
        assert asyncio.run(main()) == ([FP32], True)


def test_async_generator_decorator_covers_each_step():
    """Covered like a generator: each step of the body (asend, athrow,
    aclose, and awaits inside it) runs switched, the consumer's code and
    other tasks between them do not."""
    log = []

    @hmp.disable_casts()
    async def agen(other_ran):
        try:
            got = yield _mm_dtype()
            while True:
                await asyncio.sleep(0)  # other tasks run here, cast
                try:
                    got = yield (got, _mm_dtype(), other_ran.is_set())
                except KeyError:
                    got = yield ("caught", _mm_dtype())
        finally:
            log.append(("finally", _mm_dtype(), other_ran.is_set()))

    @hmp.disable_casts()
    async def finite(n):
        for _ in range(n):
            yield _mm_dtype()

    async def other(other_ran):
        log.append(("other", _mm_dtype()))
        other_ran.set()

    async def main():
        other_ran = asyncio.Event()
        it = agen(other_ran)
        assert await it.asend(None) == FP32
        assert _mm_dtype() == BF16
        task = asyncio.ensure_future(other(other_ran))
        assert await it.asend("x") == ("x", FP32, True)  # other ran during the body's await
        await task
        assert await it.athrow(KeyError()) == ("caught", FP32)
        assert _mm_dtype() == BF16
        await it.aclose()
        assert hmp.casts_enabled()
        return [x async for x in finite(2)], hmp.casts_enabled()

    assert inspect.isasyncgenfunction(agen) and agen.__name__ == "agen"
    with hmp.converted():
        assert asyncio.run(main()) == ([FP32, FP32], True)
    assert log == [("other", BF16), ("finally", FP32, True)]
