"""The weight-cast cache: never stale, gradients identical, memory bounded."""

import copy
import gc

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.cache import cache

BF16 = torch.bfloat16
# the unpatched kernel behind F.linear: computing the expectation through it
# involves no hmp code (a disable_casts block would itself empty the cache)
aten_linear = torch._C._nn.linear

UPDATES = ["mul_", "add_", "copy_", "data_assign", "data_inplace_in_disable", "optimizer_step", "zero_"]


def apply_update(kind, p, opt):
    if kind == "mul_":
        with torch.no_grad():
            p.mul_(1.5)
    elif kind == "add_":
        with torch.no_grad():
            p.add_(torch.ones_like(p))
    elif kind == "copy_":
        with torch.no_grad():
            p.copy_(torch.randn_like(p))
    elif kind == "zero_":
        with torch.no_grad():
            p.zero_()
    elif kind == "data_assign":
        p.data = torch.randn_like(p)
    elif kind == "data_inplace_in_disable":
        # .data bypasses the version counter: the block's exit empties the cache
        with hmp.disable_casts():
            p.data.mul_(-1)
    elif kind == "optimizer_step":
        p.grad = torch.ones_like(p)
        with hmp.disable_casts():
            opt.step()


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(UPDATES), st.booleans(), st.integers(1, 3)), min_size=1, max_size=8))
def test_cache_never_returns_a_stale_value(steps):
    torch.manual_seed(0)
    hmp.convert()
    try:
        w = torch.nn.Parameter(torch.randn(4, 6))
        opt = torch.optim.SGD([w], lr=0.1)
        x = torch.randn(3, 6)
        for update, grad_mode, uses in steps:
            apply_update(update, w, opt)
            with torch.set_grad_enabled(grad_mode):
                for _ in range(uses):
                    got = F.linear(x, w)
                    expect = aten_linear(x.to(BF16), w.detach().to(BF16))
                    assert torch.equal(got.detach(), expect)
                    assert got.requires_grad == grad_mode
    finally:
        hmp.revert()


def _train(use_cache, accumulate, evaluate_between):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(6, 8, 16)
    target = torch.randint(0, 4, (6, 8))
    hmp.convert(cache=use_cache)
    grads = []
    try:
        for step in range(3):
            opt.zero_grad()
            for micro in range(accumulate):
                i = (step * accumulate + micro) % 6
                F.cross_entropy(model(data[i]), target[i]).backward()
                if evaluate_between:
                    with torch.no_grad():
                        model(data[0])
            grads.append([p.grad.clone() for p in model.parameters()])
            with hmp.disable_casts():
                opt.step()
    finally:
        hmp.revert()
    return grads, [p.detach().clone() for p in model.parameters()]


def test_gradients_identical_with_and_without_cache():
    for accumulate, evaluate_between in [(1, False), (3, False), (3, True)]:
        g1, p1 = _train(True, accumulate, evaluate_between)
        g0, p0 = _train(False, accumulate, evaluate_between)
        for a, b in zip(sum(g1, []), sum(g0, [])):
            assert a.dtype == torch.float32 and torch.equal(a, b)
        for a, b in zip(p1, p0):
            assert torch.equal(a, b)


def test_weight_cast_once_per_step_and_survives_inference_calls():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        first = lin(x)
        entry = cache._entries[id(lin.weight)][4]
        lin(x)
        assert cache._entries[id(lin.weight)][4] is entry  # reused across calls
        assert torch.equal(lin(x), first)
        lin.weight.add_(1)  # bumps the version
        assert cache._entries[id(lin.weight)][4] is entry
        lin(x)
        assert cache._entries[id(lin.weight)][4] is not entry


def test_memory_bounded_and_dies_with_tensor():
    hmp.convert()
    x = torch.randn(2, 8)
    with torch.no_grad():
        lin = torch.nn.Linear(8, 8)
        for _ in range(5):
            lin(x)
        assert len(cache) == 2  # weight and bias, one copy each
        for mode in (True, False):
            with torch.set_grad_enabled(mode):
                lin(x)
        assert len(cache) == 2
        del lin
        gc.collect()
        assert len(cache) == 0


def test_clear_cache_and_cache_off():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    with torch.no_grad():
        lin(torch.randn(2, 8))
    assert len(cache) == 2
    hmp.clear_cache()
    assert len(cache) == 0
    hmp.convert(cache=False)
    with torch.no_grad():
        out = lin(torch.randn(2, 8))
    assert out.dtype == BF16 and len(cache) == 0
    hmp.convert()
    with torch.no_grad():
        lin(torch.randn(2, 8))
    hmp.revert()
    assert len(cache) == 0


def test_deepcopied_model_does_not_share_entries():
    hmp.convert()
    a = torch.nn.Linear(4, 4)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.weight.mul_(2)
        x = torch.randn(1, 4)
        ya, yb = a(x), b(x)
    assert not torch.equal(ya, yb)
