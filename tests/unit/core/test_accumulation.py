"""hmp.accumulation() (issue 56 item 5): with gradient accumulation each trainable weight is cast
once per optimizer step, where torch.autocast casts it in every micro-batch's forward. Counted
(``aten._to_copy`` of a weight's shape), never timed; values compared bit for bit."""

import threading

import pytest
import torch

import hmp
from hmp.tools.launches import count

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

K = 4  # micro-batches per step


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(2, 16) for _ in range(K)]
    return model, opt, xs


def _weight_casts(fn, model):
    """Casts of the model's weights (by shape: the activations here have other shapes)."""
    shapes = {tuple(p.shape) for p in model.parameters()}
    n = 0

    def seen(op, args, kwargs):
        nonlocal n
        if op is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes and args[0].dtype is torch.float32:
            n += 1

    from hmp.binding.aten import dispatched

    dispatched(fn, seen)
    return n


def _micro_batches(model, xs):
    for x in xs:
        model(x).float().pow(2).mean().backward()


def test_each_weight_is_cast_once_per_step_inside_and_per_micro_batch_outside():
    model, opt, xs = _setup()
    n_weights = len(list(model.parameters()))
    with hmp.converted():
        outside = _weight_casts(lambda: _micro_batches(model, xs), model)
        opt.zero_grad()
        with hmp.accumulation():
            inside = _weight_casts(lambda: _micro_batches(model, xs), model)
            assert hmp.cache_bytes() == sum(p.numel() * 2 for p in model.parameters())  # one bf16 copy each
        assert hmp.cache_bytes() == 0  # released at the block's exit
    assert outside == K * n_weights
    assert inside == n_weights


def test_gradients_and_weights_are_bit_for_bit_those_without_the_block():
    runs = []
    for scoped in (False, True):
        model, opt, xs = _setup()
        with hmp.converted():
            for _ in range(3):  # three optimizer steps of K micro-batches
                if scoped:
                    with hmp.accumulation():
                        _micro_batches(model, xs)
                else:
                    _micro_batches(model, xs)
                grads = [p.grad.clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
        runs.append((grads, [p.detach().clone() for p in model.parameters()]))
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_optimizer_step_releases_the_copies_and_the_next_step_sees_new_weights():
    model, opt, xs = _setup()
    n_weights = len(list(model.parameters()))
    with hmp.converted(), hmp.accumulation():
        _micro_batches(model, xs)
        opt.step()
        assert hmp.cache_bytes() == 0  # the step rewrote every weight: its copies went
        opt.zero_grad()
        again = _weight_casts(lambda: _micro_batches(model, xs), model)
        out = model(xs[0])
    assert again == n_weights
    with hmp.converted():
        want = model(xs[0])  # the updated weights, cast fresh
    assert torch.equal(out, want)


def test_a_write_hmp_sees_between_micro_batches_is_cast_again():
    model, _, xs = _setup()
    with hmp.converted(), hmp.accumulation():
        first = model(xs[0])
        with torch.no_grad():
            model[0].weight.mul_(2.0)  # in place: the version counter moves
        second = model(xs[0])
        model[2].weight = torch.nn.Parameter(model[2].weight.detach() * 3.0)  # a new tensor
        third = model(xs[0])
    with hmp.converted():
        want = model(xs[0])
    assert not torch.equal(first, second)
    assert torch.equal(third, want)


def _hand_written_steps(model, xs, steps, update, reset):
    """``steps`` optimizer steps written by hand: K micro-batches, then ``update`` and ``reset``."""
    sizes = []
    for _ in range(steps):
        _micro_batches(model, xs)
        for p in model.parameters():
            update(p)
            reset(p)
        sizes.append(hmp.cache_bytes())
    return sizes


def _data_update(p):
    p.data.add_(p.grad, alpha=-0.1)  # moves neither the version counter nor the data pointer


def _no_grad_update(p):
    with torch.no_grad():
        p -= 0.1 * p.grad


def _set_to_none(p):
    p.grad = None


def _zeroed_in_place(p):
    p.grad.zero_()


def _weights_after(update, reset, scoped, steps=3):
    model, _, xs = _setup()
    with hmp.converted():
        if scoped:
            with hmp.accumulation():
                sizes = _hand_written_steps(model, xs, steps, update, reset)
        else:
            sizes = _hand_written_steps(model, xs, steps, update, reset)
    return [p.detach().clone() for p in model.parameters()], sizes


def test_a_hand_written_data_update_is_seen_at_the_gradient_reset():
    """A loop that updates through ``.data`` and resets the gradients to None: the reset after a
    backward pass is the step boundary, so the next step casts the updated weights."""
    inside, _ = _weights_after(_data_update, _set_to_none, scoped=True)
    outside, _ = _weights_after(_data_update, _set_to_none, scoped=False)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))


def test_a_data_update_with_gradients_zeroed_in_place_is_the_limit():
    """The documented limit: gradients zeroed in place leave no boundary to see, so the block
    serves the first step's copies (hmp.clear_cache() after the update is the way out)."""
    inside, _ = _weights_after(_data_update, _zeroed_in_place, scoped=True)
    outside, _ = _weights_after(_data_update, _zeroed_in_place, scoped=False)
    assert not all(torch.equal(a, b) for a, b in zip(inside, outside))

    def cleared(p):
        _zeroed_in_place(p)
        hmp.clear_cache()

    fixed, _ = _weights_after(_data_update, cleared, scoped=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, outside))


def test_a_hand_written_update_keeps_one_copy_per_weight():
    """A no-grad update moves the version counter: each step casts again, and its copy replaces the
    last one, so the block never holds more than one copy per weight."""
    model, _, _ = _setup()
    one_copy = sum(p.numel() * 2 for p in model.parameters())
    inside, sizes = _weights_after(_no_grad_update, _set_to_none, scoped=True, steps=4)
    outside, _ = _weights_after(_no_grad_update, _set_to_none, scoped=False, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))
    assert max(sizes) <= one_copy, sizes


def test_clear_cache_nesting_and_threads():
    model, _, xs = _setup()
    seen = {}
    with hmp.converted(), hmp.accumulation():
        model(xs[0])
        with hmp.accumulation():  # nested: the outer block owns the copies
            model(xs[0])
        assert hmp.cache_bytes() > 0
        hmp.clear_cache()
        assert hmp.cache_bytes() == 0

        def other():  # another thread is not inside the block: it keeps nothing past its graph
            model(xs[1])
            seen["other"] = _weight_casts(lambda: model(xs[1]), model)

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["other"] == len(list(model.parameters()))


def test_a_step_counts_fewer_kernels_than_autocasts():
    model, opt, xs = _setup()

    def autocast_step():
        for x in xs:
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()

    autocast = count(autocast_step).ops["aten._to_copy"]
    opt.zero_grad()
    with hmp.converted(), hmp.accumulation():
        mine = count(_micro_batches, model, xs).ops["aten._to_copy"]
    assert mine < autocast
