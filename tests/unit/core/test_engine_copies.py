"""engine="autocast" keeps torch.autocast's weight copies where hmp sees every write (issue 78 item 3;
docs/engines.md, "Weight copies"): autocast's cache is on in the threads the engine programs, and
hmp drops it (hmp/core/delegation.py, ``drop``) at every point where it sees a weight may change.
Counted (the casts a dispatch mode sees), never timed; values compared bit for bit, against a fresh
cast and against engine="python". No delegated op casts down (docs/engines.md), so the weights these
tests use are cast by hmp's wrappers on both engines: autocast's own limits are pinned with
torch.autocast, and beside them the engine gives what engine="python" gives."""

import contextlib
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import casts
from helpers.models import KVDecoder

import hmp
from hmp.core.delegation import copies_keep_graphs

BF16 = torch.bfloat16
ENGINES = ("python", "autocast")
K = 4  # micro-batches per optimizer step

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# -- a decoder with a KV cache: one token per call, as generate() runs it ---------------------------
# (transformers' Llama through its own decode loop: tests/integration/test_llama_decode_casts.py)


def decode(model, tokens=4):
    """Under no_grad: a prompt, then ``tokens`` tokens; each token's casts, weight casts and logits."""
    cache = [None] * len(model.blocks)
    weights = list(model.parameters())
    with torch.no_grad():
        model(torch.arange(6).view(1, 6), cache)
        return [casts(lambda t=t: model(torch.tensor([[t]]), cache), weights) for t in range(tokens)]


@pytest.mark.parametrize("trainable", [True, False], ids=["requires_grad", "frozen"])
def test_a_decode_token_casts_the_weights_autocast_casts_and_computes_the_python_engines_logits(trainable):
    """A decoder whose lists differ from autocast's (softmax in hmp's FP32 list): the engine casts the
    weights torch.autocast casts per token, and its logits are engine="python"'s, bit for bit."""
    torch.manual_seed(0)
    model = KVDecoder().eval().requires_grad_(trainable)
    n_weights = sum(1 for n, _ in model.named_parameters() if not n.startswith("emb"))  # the linears'
    with torch.autocast("cpu", dtype=BF16):
        stock = decode(model)
    found = {}
    for engine in ENGINES:
        with hmp.converted(engine=engine):
            found[engine] = decode(model)
    for (_, weight_casts, _), (_, stock_weight_casts, _) in zip(found["autocast"], stock):
        assert weight_casts == stock_weight_casts == (0 if trainable else n_weights)
    for (_, _, logits), (_, _, python_logits) in zip(found["autocast"], found["python"]):
        assert logits.dtype == python_logits.dtype and torch.equal(logits, python_logits)


def test_before_this_the_engine_cast_every_weight_at_every_token():
    """What the engine's kept weight copies save here (hmp's cache: the engine keeps every product,
    linear included, in hmp's wrapper), counted with the caches off as the engine ran before
    (``convert(cache=False)``, autocast's too): every linear's weight and bias at every token."""
    torch.manual_seed(0)
    model = KVDecoder().eval()
    n_weights = sum(1 for n, _ in model.named_parameters() if not n.startswith("emb"))
    with hmp.converted(engine="autocast", cache=False):
        assert not torch.is_autocast_cache_enabled()
        off = decode(model)
    with hmp.converted(engine="autocast"):
        on = decode(model)
    assert all(w == n_weights for _, w, _ in off) and all(w == 0 for _, w, _ in on)
    assert all(a - b == n_weights for (a, _, _), (b, _, _) in zip(off, on))


# -- accumulation(): each weight cast once per optimizer step -----------------------------------------


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(2, 16) for _ in range(K)]


def _micro_batches(model, xs, region=None):
    for x in xs:
        with region() if region else torch.enable_grad():
            y = model(x)
        y.float().pow(2).mean().backward()


def test_in_accumulation_each_weight_is_cast_once_per_step():
    """Inside accumulation() a backward pass keeps autocast's copies: one cast per weight per step, where
    torch.autocast (a region per forward) and the engine outside the block cast every micro-batch."""
    model, opt, xs = _setup()
    weights = list(model.parameters())

    def step(region=None):
        n = casts(lambda: _micro_batches(model, xs, region), weights)[1]
        opt.step()
        opt.zero_grad()
        return n

    stock = step(lambda: torch.autocast("cpu", dtype=BF16))
    with hmp.converted(engine="autocast"):
        outside = step()
        with hmp.accumulation():
            inside = [step(), step()]  # the step drops them: the next step casts the new weights once
    assert stock == outside == K * len(weights)
    assert inside == [len(weights)] * 2


def train_and_evaluate(accumulate):
    """Three optimizer steps of K micro-batches with a tied weight used twice per forward, an
    evaluation under no_grad between steps: every output, gradient and weight."""
    torch.manual_seed(0)
    model, opt, xs = _setup()
    tied = nn.Parameter(torch.randn(8, 8))
    seen = []
    for _ in range(3):
        with hmp.accumulation() if accumulate else torch.enable_grad():
            for x in xs:
                y = F.linear(F.linear(model(x), tied), tied)  # a weight used twice: one copy, one sum
                y.float().pow(2).mean().backward()
                seen.append(y.detach())
            seen += [p.grad.clone() for p in [*model.parameters(), tied]]
            opt.step()
            tied.data -= 0.1 * tied.grad  # a hand-written update at the step, through .data
            opt.zero_grad()
            tied.grad = None
            hmp.clear_cache()  # which the docs ask for after a write through .data
        with torch.no_grad():
            seen.append(model(xs[0]))
    return seen + [p.detach().clone() for p in [*model.parameters(), tied]]


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulation"])
def test_training_with_kept_copies_is_bit_equal_to_the_python_engine(accumulate):
    found = {}
    for engine in ENGINES:
        with hmp.converted(engine=engine):
            found[engine] = train_and_evaluate(accumulate)
    assert len(found["python"]) == len(found["autocast"])
    for i, (p, a) in enumerate(zip(found["python"], found["autocast"])):
        assert p.dtype == a.dtype and torch.equal(p, a), f"tensor {i} differs between the engines"


# -- every write hmp sees is seen by the next forward ---------------------------------------------------


def _linear(tiny=False):
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)
    if tiny:  # values float16 flushes to zero and bfloat16 keeps; no bias to hide them
        with torch.no_grad():
            lin.weight.mul_(1e-9)
            lin.bias.zero_()
    return lin, x


def _step(kind):
    def write(lin, x):
        opt = {
            "single": lambda: torch.optim.SGD(lin.parameters(), lr=0.5, foreach=False),
            "foreach": lambda: torch.optim.SGD(lin.parameters(), lr=0.5, foreach=True),
            "fused": lambda: torch.optim.Adam(lin.parameters(), lr=0.5, fused=True),
        }[kind]()
        lin(x).float().sum().backward()  # inside accumulation(): the backward keeps the copies
        opt.step()

    return write


def _load(assign):
    def write(lin, x):
        lin.load_state_dict({k: v * 2 for k, v in lin.state_dict().items()}, assign=assign)

    return write


def _to(lin, x):
    lin.half().float()  # Module._apply: a .data write of each parameter


def _clear_cache(lin, x):
    lin.weight.data.mul_(2)  # a write no counter shows
    hmp.clear_cache()


def _refill(lin, x):
    with torch.autograd._unsafe_preserve_version_counter(lin.weight):  # FSDP2's all-gather copy-out
        lin.weight.data.mul_(2)


def _no_grad_write(lin, x):
    with torch.no_grad():
        lin.weight.mul_(2)


WRITES = {
    "SGD step": _step("single"),
    "SGD foreach step": _step("foreach"),
    "Adam fused step": _step("fused"),
    "load_state_dict": _load(False),
    "load_state_dict(assign=True)": _load(True),
    "model.to()": _to,
    "clear_cache()": _clear_cache,
    "a refill": _refill,
    "a no-grad write between regions": _no_grad_write,
}


def _keeping(where, lin, named):
    """Where copies outlive a forward: grad mode inside accumulation() (its backward keeps them), or no-grad
    regions inside frozen_weights() (its regions keep them; ``named``: convert(model=...) names ``lin``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(hmp.converted(engine="autocast", model=lin if named else None))
    stack.enter_context(hmp.accumulation())
    if where == "frozen_weights":
        stack.enter_context(hmp.frozen_weights())
    return stack


@pytest.mark.parametrize("where", ["grad", "frozen_weights"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_every_write_hmp_sees_is_seen_by_the_next_forward(write, where):
    """A forward keeps autocast's copies, the write, the next forward: it computes what a fresh cast
    gives, which the first forward's copy would not. Inside frozen_weights() no region drops the copies,
    so each write is seen by its own drop; a no-grad write between regions there is seen where
    convert(model=...) names the model (below, its limit without)."""
    if write == "Adam fused step":
        try:
            torch.optim.Adam([nn.Parameter(torch.ones(1))], fused=True).step()
        except RuntimeError as e:
            pytest.skip(f"fused Adam on the CPU: {e}")
    lin, x = _linear(tiny=write == "model.to()")
    forward = torch.no_grad if where == "frozen_weights" else torch.enable_grad
    with _keeping(where, lin, named=write == "a no-grad write between regions"):
        with forward():
            before = lin(x)
            _, weight_casts, kept = casts(lambda: lin(x), [lin.weight])
        assert weight_casts == 0  # the copy is kept
        WRITES[write](lin, x)
        with forward():
            after = lin(x)
        torch.clear_autocast_cache()
        with forward():
            fresh = lin(x)
    assert torch.equal(kept, before)
    assert torch.equal(after, fresh)
    assert not torch.equal(before, fresh), "the write changed nothing a stale copy would show"


SWAPS = {
    "model.double()": lambda lin: lin.double(),
    "swap_tensors": lambda lin: torch.utils.swap_tensors(lin.weight, nn.Parameter(torch.randn(8, 8))),
}


@pytest.mark.parametrize("swap", sorted(SWAPS))
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_swap_works_after_the_engine_cast_the_weights(swap, grad):
    """torch.utils.swap_tensors (model.to() under swap-on-conversion, load_state_dict(assign=True), DTensor)
    refuses a tensor autocast's cache points to ('Expected no weakrefs'): it drops the copies first."""
    lin, x = _linear()
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with hmp.converted(engine="autocast"), torch.set_grad_enabled(grad):
            lin(x)  # its output dropped: only autocast's cache holds the copy
            SWAPS[swap](lin)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


# -- the limits: what autocast's region misses, the engine misses -----------------------------------------


def _in_place(lin):
    lin.weight.mul_(2)


def _data_write(lin):
    lin.weight.data.mul_(2)


def _around(write, *blocks):
    """``(before, after, fresh)``: forwards inside ``blocks`` around ``write``, then a fresh cast."""
    lin, x = _linear()
    with contextlib.ExitStack() as stack:
        for block in blocks:
            stack.enter_context(block)
        before = lin(x)
        write(lin)
        after = lin(x)
    torch.clear_autocast_cache()
    with torch.autocast("cpu", dtype=BF16):
        fresh = lin(x)
    return before, after, fresh


@pytest.mark.parametrize(
    "limit, write, grad",
    [
        ("an in-place write between two uses inside one no-grad block", _in_place, False),
        ("a .data write between two grad-mode forwards with no backward between", _data_write, True),
    ],
)
def test_a_write_autocasts_region_misses_gives_the_python_engines_result_on_the_engine(limit, write, grad):
    before, after, fresh = _around(write, torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=BF16))
    assert torch.equal(after, before) and not torch.equal(after, fresh), limit
    python, engine = (_around(write, hmp.converted(engine=e), torch.set_grad_enabled(grad)) for e in ENGINES)
    assert all(torch.equal(p, a) for p, a in zip(python, engine)), limit


def test_grad_turned_off_by_a_call_gives_the_python_engines_result():
    """torch.set_grad_enabled(False) called, not entered: hmp sees no region; a write in place between
    two calls is seen on both engines (hmp's copies, checked per use)."""
    found = {}
    for engine in ENGINES:
        lin, x = _linear()
        with hmp.converted(engine=engine):
            torch.set_grad_enabled(False)
            try:
                before = lin(x)
                lin.weight.mul_(2)
                after = lin(x)
            finally:
                torch.set_grad_enabled(True)
            with torch.no_grad():  # a region
                fresh = lin(x)
        found[engine] = before, after, fresh
    assert all(torch.equal(p, a) for p, a in zip(found["python"], found["autocast"]))
    assert torch.equal(found["autocast"][1], found["autocast"][2])


def _no_grad_by_a_call(lin, x):
    torch.set_grad_enabled(False)
    try:
        lin(x)
    finally:
        torch.set_grad_enabled(True)


def _no_grad_in_another_thread(lin, x, around):
    inside, leave = threading.Event(), threading.Event()

    def other():
        with around(), torch.no_grad():
            lin(x)
            inside.set()
            leave.wait()

    t = threading.Thread(target=other)
    t.start()
    inside.wait()
    return t, leave


@pytest.mark.parametrize("where", ["grad turned off by a call", "another thread's no_grad region"])
def test_a_training_forward_after_a_copy_made_without_grad_gives_the_python_engines_gradient(where):
    """A copy made with grad off before a training forward, where the training thread passes no
    boundary (grad turned off by a call, which hmp does not see; another thread's no_grad region).
    Inside torch.autocast regions autocast's cache serves the copy (torch 2.4 then raises that the
    output needs no grad, for the call; later releases give the weight its gradient). On the engine
    the weight is cast by hmp's wrapper, so it gets its gradient, as under engine="python", on every
    release."""

    def outcome(around):
        lin, x = _linear()
        with around():
            held = None
            if where == "grad turned off by a call":
                _no_grad_by_a_call(lin, x)
            else:
                held = _no_grad_in_another_thread(lin, x, around if around is stock_region else contextlib.nullcontext)
            try:
                lin(x).float().sum().backward()
                found = lin.weight.grad
            except RuntimeError as e:
                found = str(e)
            finally:
                if held is not None:
                    held[1].set()
                    held[0].join()
        return found

    def stock_region():
        return torch.autocast("cpu", dtype=BF16)

    engine = outcome(lambda: hmp.converted(engine="autocast"))
    python = outcome(lambda: hmp.converted(engine="python"))
    assert torch.is_tensor(engine) and torch.equal(engine, python)
    if where == "grad turned off by a call":  # torch.autocast's own: the copy made without grad is served
        assert torch.is_tensor(outcome(stock_region)) == copies_keep_graphs()


@pytest.mark.parametrize("island", ["enable_grad", "set_grad_enabled(True)"])
def test_grad_turned_back_on_inside_a_region_gives_the_weight_its_gradient(island):
    """A training forward inside a no-grad region (input attribution, guidance): torch 2.4's autocast
    cache serves the copy the region made, which has no graph, so the weight got no gradient (raised
    here: nothing else needs one). Grad turned back on by a block drops the copies."""
    found = {}
    for engine in ENGINES:
        lin, x = _linear()
        with hmp.converted(engine=engine), torch.no_grad():
            lin(x)
            with torch.enable_grad() if island == "enable_grad" else torch.set_grad_enabled(True):
                lin(x).float().sum().backward()
        found[engine] = lin.weight.grad
    assert found["autocast"] is not None and torch.equal(found["autocast"], found["python"])


def test_autocasts_cache_is_one_per_process():
    """What the drops rely on (torch 2.4 to 2.15): a copy one thread made is another thread's hit,
    and torch.clear_autocast_cache() in any thread drops it. If a release made it per thread, a step
    in one thread would no longer drop another thread's copies."""
    lin, x = _linear()
    with torch.autocast("cpu", dtype=BF16):
        lin(x)
        other = []

        def hits():
            with torch.autocast("cpu", dtype=BF16):
                other.append(casts(lambda: lin(x), [lin.weight])[1])
            torch.clear_autocast_cache()

        t = threading.Thread(target=hits)
        t.start()
        t.join()
        assert other == [0]  # the copy this thread made
        assert casts(lambda: lin(x), [lin.weight])[1] == 1  # the other thread's clear dropped it


@pytest.mark.parametrize("engine", ENGINES)
def test_a_write_in_another_thread_is_seen_by_the_next_call(engine):
    """Another thread's write through a no-grad block is seen by the next call inside this thread's
    open region, and so is one inside a block it had already entered (hmp's copies, checked per use,
    on both engines)."""
    lin, x = _linear()
    steps = [threading.Event() for _ in range(4)]

    def writer():
        with torch.no_grad():
            lin.weight.mul_(2)  # its region's entry dropped the copies
            steps[0].set()
            steps[1].wait()
            lin.weight.mul_(2)  # inside the block it entered: no boundary
            steps[2].set()
            steps[3].wait()

    with hmp.converted(engine=engine):
        with torch.no_grad():
            lin(x)
            t = threading.Thread(target=writer)
            t.start()
            steps[0].wait()
            seen = lin(x)
            steps[1].set()
            steps[2].wait()
            missed = lin(x)
            steps[3].set()
            t.join()
        fresh = lin(x)
    assert torch.equal(missed, fresh) and not torch.equal(seen, missed)
    with hmp.disable_casts():
        want = F.linear(x.to(BF16), (lin.weight / 2).to(BF16), lin.bias.to(BF16))
    assert torch.equal(seen, want)


# -- frozen_weights(): copies kept across regions ----------------------------------------------------


def test_frozen_weights_keep_trainable_and_frozen_weights_copies_across_regions_on_both_engines():
    """Inside frozen_weights() a weight is cast once across regions, trainable or frozen
    (requires_grad=False, which autocast's cache never keeps): hmp's copies, on both engines."""
    found = {}
    for engine in ENGINES:
        lin, x = _linear()
        frozen = nn.Linear(8, 8).requires_grad_(False)
        with hmp.converted(engine=engine), hmp.frozen_weights():

            def three_regions(m, x=x):
                def run():
                    for _ in range(3):
                        with torch.no_grad():
                            m(x)

                return casts(run, list(m.parameters()))[1]

            found[engine] = three_regions(lin), three_regions(frozen)
    assert found["autocast"] == found["python"] == (2, 2)


@pytest.mark.parametrize("named", [True, False], ids=["model named", "no model"])
def test_a_write_between_regions_inside_frozen_weights_is_seen_on_both_engines(named):
    """Inside frozen_weights() regions keep the copies; an in-place write between regions is seen,
    whether or not convert(model=...) names the model: the copies are hmp's, whose version is
    checked per use, on both engines (autocast's would need the model's check, docs/engines.md)."""
    found = {}
    for engine in ENGINES:
        lin, x = _linear()
        with hmp.converted(engine=engine, model=lin if named else None), hmp.frozen_weights():
            with torch.no_grad():
                before = lin(x)
            with torch.no_grad():
                lin.weight.mul_(2)
            with torch.no_grad():
                after = lin(x)
            hmp.clear_cache()
            with torch.no_grad():
                fresh = lin(x)
        found[engine] = before, after, fresh
    assert all(torch.equal(p, a) for p, a in zip(found["python"], found["autocast"]))
    before, after, fresh = found["autocast"]
    assert not torch.equal(before, fresh) and torch.equal(after, fresh)


@pytest.mark.parametrize("named", [True, False], ids=["model named", "no model"])
def test_a_data_write_before_a_backward_inside_accumulation_is_seen_on_both_engines(named):
    """Inside accumulation() a backward keeps the copies; ``p.data = ...`` between a forward and its
    backward is seen by the next micro-batch, whether or not the model is named: the copies are
    hmp's, on both engines (autocast's would need the model's check, docs/engines.md)."""
    found = {}
    for engine in ENGINES:
        lin, x = _linear()
        with hmp.converted(engine=engine, model=lin if named else None), hmp.accumulation():
            before = lin(x)
            lin.weight.data = lin.weight.data * 2
            before.float().sum().backward()
            after = lin(x)
            hmp.clear_cache()
            fresh = lin(x)
        found[engine] = before, after, fresh
    assert all(torch.equal(p, a) for p, a in zip(found["python"], found["autocast"]))
    before, after, fresh = found["autocast"]
    assert not torch.equal(before, fresh) and torch.equal(after, fresh)


# -- the rest of a copy's life ------------------------------------------------------------------------


def test_an_autocast_region_turned_off_inside_keeps_the_copies():
    """A library's torch.autocast(enabled=False) block (transformers 4.57's rotary embedding, in every
    forward): torch clears autocast's cache where its last region exits, so a joined thread counts as
    inside one, and the block's exit drops nothing."""
    lin, x = _linear()
    with hmp.converted(engine="autocast"), torch.no_grad():
        lin(x)
        with torch.autocast("cpu", enabled=False):
            pass
        assert casts(lambda: lin(x), [lin.weight])[1] == 0


def test_a_users_region_in_another_dtype_gets_its_own_copies_and_leaves_none():
    """Autocast's cache is keyed by the weight alone: a float16 region inside the engine must not be
    served the engine's bfloat16 copies, nor leave its float16 ones to the engine."""
    lin, x = _linear()
    with hmp.converted(engine="autocast"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hmp says once that the region is the author's
        assert lin(x).dtype is BF16
        with torch.autocast("cpu", dtype=torch.float16):
            assert lin(x).dtype is torch.float16
        assert lin(x).dtype is BF16


def _nesting():
    """The thread's torch.autocast nesting (read by moving it and back)."""
    n = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return n - 1


def test_jit_trace_after_a_warm_up_follows_the_weights():
    """torch.jit.trace records a copy kept from before the trace as a constant (a copy with a graph
    cannot be one: torch raises): the traced forward runs with autocast's cache off."""
    lin, x = _linear()
    with hmp.converted(engine="autocast"):
        with torch.no_grad():
            lin(x)
            traced = torch.jit.trace(lin, x, check_trace=False)
        live = lin(x)  # a grad-mode copy kept while tracing
        traced_grad = torch.jit.trace(lin, x, check_trace=False)
        with torch.no_grad():
            lin.weight.mul_(2)
            assert torch.equal(traced(x), lin(x)) and torch.equal(traced_grad(x), lin(x))
        assert torch.is_autocast_cache_enabled()
    del live


def test_revert_drops_the_copies_and_puts_the_threads_cache_switch_back():
    lin, x = _linear()
    torch.set_autocast_cache_enabled(False)
    nesting = _nesting()
    try:
        hmp.convert(engine="autocast")
        assert torch.is_autocast_cache_enabled() and _nesting() == nesting + 1
        lin(x)  # kept until a boundary
        hmp.revert()
        assert not torch.is_autocast_cache_enabled() and _nesting() == nesting
    finally:
        torch.set_autocast_cache_enabled(True)
    with torch.autocast("cpu", dtype=BF16):
        assert casts(lambda: lin(x), [lin.weight])[1] == 1  # nothing of the conversion's left to hit


def test_a_compiled_optimizer_step_drops_the_copies(fresh_dynamo):
    """The step hooks run inside the compiled step: their drop is a node of the graph (torch 2.13,
    2.15) or a graph break (2.4), so the copies go when the compiled step runs."""
    lin, x = _linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    step = torch.compile(opt.step, backend="eager")
    with hmp.converted(engine="autocast"), hmp.accumulation():  # the backward keeps the copies
        for _ in range(2):
            before = lin(x)
            before.float().sum().backward()
            step()
            after = lin(x)
            torch.clear_autocast_cache()
            fresh = lin(x)
            assert torch.equal(after, fresh) and not torch.equal(before, fresh)
