"""disable_casts() and enable_casts(): nesting, decorators, exceptions, threads,
and the outermost op deciding."""

import threading

import pytest
import torch

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
