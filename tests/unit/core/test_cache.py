"""The weight-cast cache never changes a result: every run with the cache on
computes exactly what the same run computes with ``convert(cache=False)``
(the oracle), whatever writes the weights."""

import contextlib
import copy
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers.models import tied_training
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.core import cache
from hmp.core.state import weight_cache

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _update(kind, model, opts, x):
    p = model.emb
    if kind == "mul_":
        with torch.no_grad():
            p.mul_(0.9)
    elif kind == "copy_":
        with torch.no_grad():
            p.copy_(torch.randn_like(p))
    elif kind == "data_assign":
        p.data = torch.randn_like(p)
    elif kind == "data_transposed":  # the square weight's memory, read the other way: no counter, same pointer
        model.mid.weight.data = model.mid.weight.data.t()
    elif kind == "data_inplace":  # through the alias: bumps no version counter hmp can read
        p.data.mul_(-1)
    elif kind == "data_copy":
        model.mid.weight.data.copy_(torch.randn_like(model.mid.weight))
    elif kind == "data_sgd":  # a hand-written SGD loop, no disable_casts
        for q in model.parameters():
            if q.grad is not None:
                q.data -= 0.1 * q.grad
    elif kind == "refill":  # FSDP2's copy-out: a write, and the version counter put back
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(torch.randn_like(p))
    elif kind == "refill_freed":  # FSDP2's reshard and unshard: the storage freed, reallocated, refilled
        for q in model.parameters():
            storage = q.untyped_storage()
            size = storage.nbytes()
            new = torch.randn_like(q)
            storage.resize_(0)
            storage.resize_(size)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(q):
                q.copy_(new)
    elif kind == "beyond":  # a finite value bf16 cannot hold, through the weight: its cast must saturate
        with torch.no_grad():
            model.mid.weight[0, 0] = BEYOND
    elif kind == "load_state_dict":
        model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
    elif kind == "requires_grad_off_on":
        for q in model.parameters():
            q.requires_grad_(False)
        model(x).sum()
        for q in model.parameters():
            q.requires_grad_(True)
    elif kind.startswith("step_"):
        name, inside = kind[5:].split("/")
        F.mse_loss(model(x).float(), torch.zeros(x.shape[0], 6)).backward()
        if inside == "disable":
            with hmp.disable_casts():
                opts[name].step()
        else:
            opts[name].step()
        opts[name].zero_grad()


BEYOND = torch.finfo(torch.float32).max * 0.9999  # above bf16's largest finite value

UPDATES = [
    "beyond",
    "mul_",
    "copy_",
    "data_assign",
    "data_transposed",
    "data_inplace",
    "data_copy",
    "data_sgd",
    "load_state_dict",
    "refill",
    "refill_freed",
    "requires_grad_off_on",
    "step_fused/plain",
    "step_fused/disable",
    "step_foreach/plain",
    "step_single/disable",
]
# writes through another tensor on the weight's memory: no counter shows them (cache.py says where that matters)
UNSEEN = {"data_inplace", "data_copy", "data_sgd"}
USES = ["grad", "grad_backward", "no_grad", "eval_no_grad", "inference_mode", "frozen_burst"]


def _use(kind, model, x, alive=None):
    """What the run computes: the outputs to compare (``alive``: keep each
    grad-mode output, and so its graph and the copies it holds, to the end)."""
    if kind == "grad":
        out = model(x)
        if alive is not None:
            alive.append(out)
        return [out.detach()]
    if kind == "grad_backward":
        out = model(x)
        out.float().pow(2).sum().backward()
        grads = [q.grad.clone() for q in model.parameters()]
        for q in model.parameters():
            q.grad = None
        return [out.detach()] + grads
    if kind == "no_grad":
        with torch.no_grad():
            return [model(x), model(x)]
    if kind == "eval_no_grad":
        model.eval()
        with torch.no_grad():
            out = model(x)
        model.train()
        return [out]
    if kind == "inference_mode":
        with torch.inference_mode():
            return [model(x).clone()]
    if kind == "frozen_burst":  # the explicit fast path: weights unchanged inside the block
        with hmp.frozen_weights(), torch.no_grad():
            return [model(x) for _ in range(3)]
    raise AssertionError(kind)


def _run(program, use_cache, keep_graphs=False):
    model, opts, x = tied_training()
    hmp.convert(cache=use_cache)
    outs, alive = [], [] if keep_graphs else None
    try:
        for update, use in program:
            if update is not None:
                _update(update, model, opts, x)
            outs.extend(_use(use, model, x, alive))
    finally:
        hmp.revert()
    return outs


@settings(deadline=None)
@given(program=st.lists(st.tuples(st.none() | st.sampled_from(UPDATES), st.sampled_from(USES)), min_size=1, max_size=8))
def test_cache_on_computes_exactly_what_cache_off_computes(program):
    with_cache, without = _run(program, True), _run(program, False)
    assert len(with_cache) == len(without)
    for a, b in zip(with_cache, without):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@settings(deadline=None)
@given(
    program=st.lists(
        st.tuples(st.none() | st.sampled_from([u for u in UPDATES if u not in UNSEEN]), st.sampled_from(USES)),
        min_size=1,
        max_size=8,
    )
)
def test_cache_on_computes_what_cache_off_computes_while_earlier_graphs_live(program):
    """Every grad-mode output is kept to the end, so its graph holds the
    copies it used while the weights are written (the window in which FSDP2's
    refills went unseen)."""
    with_cache, without = _run(program, True, keep_graphs=True), _run(program, False, keep_graphs=True)
    assert len(with_cache) == len(without)
    for a, b in zip(with_cache, without):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_refill_that_puts_the_version_back_is_seen():
    """The write pattern of FSDP2's all-gather copy-out, on a plain layer: the
    first output's graph still holds the bf16 copy of the old weight."""
    hmp.convert()
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    new = torch.randn(16, 16)
    first = lin(x)
    version, address = lin.weight._version, lin.weight.data_ptr()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(lin.weight):
        lin.weight.copy_(new)
    assert (lin.weight._version, lin.weight.data_ptr()) == (version, address)  # nothing a per-call check reads
    want = F.linear(x.to(BF16), new.to(BF16), lin.bias.to(BF16))
    assert torch.equal(lin(x), want)
    # a view refilled (FSDP2 writes views of the all-gather output) and a frozen_weights() block
    with hmp.frozen_weights(), torch.no_grad():
        lin(x)
        with torch.autograd._unsafe_preserve_version_counter(lin.weight.view(-1)):
            lin.weight.view(-1).mul_(2)
        assert torch.equal(lin(x), F.linear(x.to(BF16), (2 * new).to(BF16), lin.bias.to(BF16)))
    del first


def test_the_version_counter_reset_is_torchs_own_after_revert():
    from hmp.core import torch_private

    namespace, attr = torch_private.VERSION_COUNTER_RESET
    original = getattr(namespace, attr)
    hmp.convert()
    assert getattr(namespace, attr) is not original
    t = torch.zeros(3)
    with torch.autograd._unsafe_preserve_version_counter(t):  # calls it
        t.add_(1)
    assert t._version == 0 and t.sum() == 3  # still torch's behaviour
    hmp.revert()
    assert getattr(namespace, attr) is original


def _loss_after(steps, use_cache, fused=True, manual=False):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    hmp.convert(cache=use_cache)
    try:
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if manual:
                for p in model.parameters():
                    p.data -= 0.05 * p.grad
                    p.grad = None
            else:
                opt.step()  # no disable_casts(): the step runs uncast by itself
                opt.zero_grad()
        return F.cross_entropy(model(x), y).item()
    finally:
        hmp.revert()


def test_fused_adamw_outside_disable_casts_trains_on_fresh_weights():
    """The issue's Trainer bug: fused kernels bump no version counter."""
    assert _loss_after(20, True) == _loss_after(20, False)
    assert _loss_after(20, True, manual=True) == _loss_after(20, False, manual=True)


def test_tied_weight_cast_once_per_forward_and_not_kept_after_backward():
    hmp.convert()
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(2, 8, requires_grad=True).clone()  # not a leaf: only w goes through the cache
    y = F.linear(F.linear(x, w), w)  # the graph saves the bf16 copy of w
    assert cache.size() == 1  # one copy, shared by both uses
    y.float().sum().backward()
    assert cache.size() == 0  # backward freed the graph, and the copy with it
    assert w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0


def test_no_grad_copies_are_not_kept_outside_a_region():
    """Grad turned off by a call, not a block: no region (tests/unit/rules/test_no_grad_regions.py has
    what a region keeps), so every call casts again and sees any write."""
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    torch.set_grad_enabled(False)
    try:
        first = lin(x)
        assert cache.size() == 0
        lin.weight.data.copy_(torch.randn(8, 8))  # invisible to any counter
        assert not torch.equal(lin(x), first)
    finally:
        torch.set_grad_enabled(True)


def test_frozen_weights_keeps_copies_until_exit_and_drops_them_on_a_step():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(2, 8)
    cast = cache.caster(BF16).any
    with hmp.frozen_weights(), torch.no_grad():
        a = cast(lin.weight)
        assert cast(lin.weight) is a  # reused across calls
        with hmp.frozen_weights():  # nested: same store
            assert cast(lin.weight) is a
        assert cast(lin.weight) is a
        lin.weight.add_(1)  # an in-place op bumps the version: a fresh copy
        b = cast(lin.weight)
        assert b is not a and torch.equal(b, lin.weight.to(BF16))
        seen = []
        thread = threading.Thread(target=lambda: seen.append(cache.size()))
        thread.start()
        thread.join()
        assert seen == [0]  # per thread
        lin.weight.grad = torch.ones(8, 8)
        with torch.enable_grad():
            opt.step()
        assert cache.size() == 0  # every optimizer step drops every copy
        out = lin(x)
    assert cache.size() == 0  # and the block's exit drops the rest
    torch.testing.assert_close(out, F.linear(x.to(BF16), lin.weight.to(BF16), lin.bias.to(BF16)), rtol=0, atol=0)


def test_requires_grad_switched_off_and_on_in_one_step_still_gets_gradients():
    """A GAN discriminator frozen for the generator's pass, then trained."""
    hmp.convert()
    d = torch.nn.Linear(8, 1)
    x = torch.randn(4, 8, requires_grad=True)
    d.requires_grad_(False)
    fake_score = d(x)  # generator pass: copies without grad_fn
    d.requires_grad_(True)
    real_score = d(x.detach())
    (fake_score.float().sum() + real_score.float().sum()).backward()
    assert d.weight.grad is not None and d.weight.grad.abs().sum() > 0
    assert x.grad is not None


def test_jit_trace_after_no_grad_warmup_follows_the_weights():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        lin(x)  # warm-up
    live = lin(x)  # and a graph still alive while tracing
    traced = torch.jit.trace(lin, x, check_trace=False)
    with torch.no_grad():
        lin.weight.mul_(2)
    torch.testing.assert_close(traced(x), lin(x), rtol=0, atol=0)
    del live


def test_functorch_grad_and_vmap_run_with_the_cache():
    from torch.func import functional_call, grad, vmap

    hmp.convert()
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    params = dict(lin.named_parameters())

    def loss(p, xb):
        return functional_call(lin, p, (xb,)).float().pow(2).sum()

    g_cache = grad(loss)(params, x)
    per_sample = vmap(lambda xb: lin(xb))(x)
    hmp.convert(cache=False)
    g_plain = grad(loss)(params, x)
    assert per_sample.dtype == BF16
    for k in g_cache:
        assert torch.equal(g_cache[k], g_plain[k])


def test_parameters_made_in_inference_mode():
    hmp.convert()
    with torch.inference_mode():
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8)
        a = lin(x)
    with torch.inference_mode():
        b = lin(x)
    assert a.dtype == BF16 and torch.equal(a, b)


def test_clear_cache_revert_and_cache_off():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    out = lin(x)
    assert cache.size() == 3  # x and the weight, which autograd saves, and the bias, which out's graph holds
    hmp.clear_cache()
    assert cache.size() == 0
    del out
    hmp.convert(cache=False)
    out = lin(x)
    assert out.dtype == BF16 and cache.size() == 0
    hmp.convert()
    out = lin(x)
    hmp.revert()
    assert cache.size() == 0


def test_entries_die_with_their_tensor_and_copies_do_not_share():
    hmp.convert()
    a = torch.nn.Linear(4, 4)
    b = copy.deepcopy(a)
    x = torch.randn(1, 4, requires_grad=True) * 1
    with torch.no_grad():
        b.weight.mul_(2)
    ya, yb = a(x), b(x)
    assert not torch.equal(ya, yb)
    del ya, yb, a, b, x
    gc.collect()
    assert cache.size() == 0 and all(len(s) == 0 for s in weight_cache.grad_mode.values())


def test_a_bias_copy_lives_as_long_as_the_graph_that_used_it():
    """Autograd does not save a bias, so its copy is held by the graph of the
    output it was made for: reused while that graph waits for backward,
    released by backward, and by dropping the output."""
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    grad_mode = weight_cache.grad_mode[BF16]

    def bias_copy():
        entry = grad_mode.get(id(lin.bias))
        return entry.copy() if entry is not None else None

    out = lin(x)
    held = bias_copy()
    assert held is not None and held.dtype == BF16
    again = lin(x)
    assert bias_copy() is held  # reused: no second cast while out's graph lives
    del held
    (out.float().sum() + again.float().sum()).backward()
    assert bias_copy() is None  # backward released it, though out and again are still referenced
    out = lin(x)
    assert bias_copy() is not None
    del out
    assert bias_copy() is None  # dropping the output released it


def test_a_value_beyond_the_range_saturates_in_the_next_region_however_it_was_written():
    """A region casts each weight again with its range check, so a finite value bf16 cannot
    hold saturates there, whether written through the weight or through the p.data alias
    (which no version counter shows: inside one region that is the cache's exception)."""
    lin = torch.nn.Linear(2, 2, bias=False)
    top = torch.finfo(BF16).max
    e0 = torch.tensor([[1.0, 0.0]])
    hmp.convert()
    try:
        with torch.no_grad():
            lin(e0)
            lin.weight[0, 0] = BEYOND  # through the weight: seen inside the region too
            assert lin(e0)[0, 0].item() == top
        with torch.no_grad():
            lin.weight.data[0, 0] = 1.0
        with torch.no_grad():
            assert lin(e0)[0, 0].item() == 1.0
        lin.weight.data[0, 0] = BEYOND  # through the alias, between regions
        with torch.no_grad():
            assert lin(e0)[0, 0].item() == top
    finally:
        hmp.revert()


# -- nothing of hmp's on a user's tensor ------------------------------------------------------------

_SWAPS = {
    "model.to": lambda m: m.to(torch.float64),
    "load_state_dict": lambda m: m.load_state_dict({k: v.clone() + 1 for k, v in m.state_dict().items()}),
    "swap_tensors": lambda m: torch.utils.swap_tensors(m.weight, torch.nn.Parameter(torch.zeros(8, 8))),
}


@pytest.mark.parametrize("when", ["converted", "inside a region", "after clear_cache", "after revert"])
@pytest.mark.parametrize("swap", list(_SWAPS))
def test_swap_based_conversion_works_after_hmp_cast_the_weights(swap, when):
    """torch.utils.swap_tensors refuses a tensor with a weak reference; nn.Module._apply and
    load_state_dict call it under swap-on-conversion (torch's announced default), and for traceable
    subclasses (DTensor). hmp keeps nothing on a parameter: its entries hold the storage weakly."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    hmp.convert()
    try:
        lin(x).float().sum().backward()  # one training step
        opt.step()
        kept = lin(x)  # a graph alive: the cache holds the weight's copy
        with torch.no_grad():
            lin(x), lin(x)  # and a region's kept copy, inside it
            if when == "inside a region":
                assert all(not weakref.getweakrefs(p) for p in lin.parameters())
                _SWAPS[swap](lin)
        if when == "after clear_cache":
            hmp.clear_cache()
        elif when == "after revert":
            hmp.revert()
        if when != "inside a region":
            assert all(not weakref.getweakrefs(p) for p in lin.parameters())
            del kept
            _SWAPS[swap](lin)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
        hmp.revert()
    lin.float()  # (model.to made them float64, which hmp leaves as the author chose)
    with hmp.converted(), torch.no_grad():
        out = lin(x), lin(x), lin(x)
    assert out[2].dtype == BF16 and torch.equal(out[2], out[0])  # the swapped weights are cast as any others


# ``p.data = ...`` moves no version counter; these keep the data pointer too, and change only the layout
LAYOUT_WRITES = {
    "transposed": lambda p: p.data.t(),  # a square weight: same shape, other strides
    "viewed": lambda p: p.data.view(4, 16),  # same memory, another shape
    "narrowed": lambda p: p.data[:4],  # the first rows: same pointer, fewer of them
}


@pytest.mark.parametrize("write", sorted(LAYOUT_WRITES))
@pytest.mark.parametrize("region", ["grad", "no_grad", "frozen_weights", "frozen_weights_frozen"])
def test_a_layout_written_through_data_between_calls_is_seen(region, write):
    """A kept copy is the weight's while its version, data pointer and layout (shape and strides)
    are those it was cast from: a ``.data`` assignment that keeps the pointer is seen, in every
    store (oracle: the same calls with ``cache=False``)."""

    def run(use_cache):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=region != "frozen_weights_frozen")
        x = torch.randn(3, 8)
        with hmp.converted(cache=use_cache), contextlib.ExitStack() as stack:
            if region.startswith("frozen_weights"):
                stack.enter_context(hmp.frozen_weights())
            if region != "grad":
                stack.enter_context(torch.no_grad())
            first = F.linear(x, w)  # grad mode: kept alive, so is the graph holding the copy
            w.data = LAYOUT_WRITES[write](w)
            x2 = x if w.shape[1] == 8 else torch.randn(3, w.shape[1])
            return first.detach(), F.linear(x2, w).detach()

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
