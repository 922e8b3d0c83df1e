"""A no-grad region keeps hmp's weight casts of weights that require grad, from their first use until
it ends (hmp/rules/no_grad_regions.py), and never serves a copy the weights no longer match: every run
computes exactly what the same run computes with ``convert(cache=False)`` (the oracle), whatever
writes the weights inside a region or between regions, except a write through another tensor on a
trainable weight's memory (``p.data``, its storage) after the region kept its copy, which no counter
shows (docs/performance.md says so, sentence by sentence naming the tests here and in
test_cache.py). Casts are counted (a TorchDispatchMode count of ``aten._to_copy``), never timed."""

import gc
import pathlib
import re
import threading
import weakref

import pytest
import torch
from helpers import needs
from helpers.models import tied_training
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import hmp
from hmp.core import cache

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


_CONVERSIONS = (torch.ops.aten._to_copy, torch.ops.aten.to)  # inference mode dispatches ``to`` itself


class Casts(TorchDispatchMode):
    """Counts the dtype conversions dispatched (``aten._to_copy``) while it is on."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _CONVERSIONS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def casts(fn, *args):
    """The conversions one call of ``fn`` dispatches, given fresh copies of its tensor arguments: the
    weights' copies are what is counted here (an activation is cast at every call:
    tests/unit/core/test_activation_casts.py)."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with Casts() as counted:
        fn(*args)
    return counted.n


# -- what a region keeps, counted -------------------------------------------------------------------


@pytest.mark.parametrize(
    "region",
    [
        torch.no_grad,
        torch.inference_mode,
        lambda: torch.set_grad_enabled(False),
        lambda: torch.autograd.grad_mode.no_grad(),
    ],
    ids=["no_grad", "inference_mode", "set_grad_enabled", "grad_mode.no_grad"],
)
def test_a_region_keeps_a_copy_from_the_first_use_and_drops_it_at_its_exit(region):
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with region():
        assert casts(lin, x) == 3  # input, weight, bias
        assert cache.size() == 2  # kept from the first use, as torch.autocast's region keeps its casts
        assert [casts(lin, x) for _ in range(3)] == [1, 1, 1]  # the input alone
        assert cache.size() == 2
        copy = weakref.ref(cache.caster(BF16).any(lin.weight))
    assert cache.size() == 0
    gc.collect()
    assert copy() is None  # freed at the exit, not kept for the next region
    with region():
        assert casts(lin, x) == 3  # a new region casts again


def test_the_outermost_region_decides_and_nested_blocks_share_it():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)

    @torch.no_grad()
    def generate(steps):  # model.generate(): a decorated function, called inside another region
        return [casts(lin, x) for _ in range(steps)]

    assert generate(3) == [3, 1, 1]  # one region per call of the decorated function
    assert generate(2) == [3, 1]
    with torch.no_grad():
        assert casts(lin, x) == 3
        assert generate(2) == [1, 1]  # inside the outer region: its entries serve
        with torch.inference_mode():
            assert casts(lin, x) == 1
        with torch.enable_grad():  # grad mode inside: the graph's copies, as always
            assert casts(lin, x) == 3
            with torch.no_grad():  # a region of its own, dropped at its exit
                assert [casts(lin, x) for _ in range(3)] == [3, 1, 1]
        assert casts(lin, x) == 1  # the outer region's copies again
    assert cache.size() == 0


def _free_pages_touched(model, x, region):
    """Bytes of the copies a region of one forward holds at once: the largest ``hmp.cache_bytes()``
    seen after each listed call (what the allocator must find fresh memory for)."""
    most = [0]

    def after(module, args, out):
        most[0] = max(most[0], hmp.cache_bytes())

    handles = [m.register_forward_hook(after) for m in model.modules()]
    try:
        with region():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return most[0]


def test_a_kept_copy_pays_one_forward_regions_cast_per_call_and_loops_keep_from_the_first_use():
    """A region of one forward uses each weight once: keeping its copies to the exit would cost fresh
    memory for each (given back at the exit, faulted in again at the next region) where a cast per call
    reuses one buffer (benchmarks/regions.py). So a thread's regions keep from a weight's first use
    while its last region that cast a weight used a kept copy again, and otherwise from a weight's
    second use in the region."""
    hmp.convert()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    copies = _bf16_bytes(model)
    assert _free_pages_touched(model, x, torch.no_grad) == copies  # a converted thread's first region keeps
    for _ in range(3):  # then one-forward regions (an evaluation step, a request) keep nothing
        assert _free_pages_touched(model, x, torch.no_grad) == 0
        with torch.no_grad():
            assert casts(model, x) == 1 + 4  # the input, and each weight and bias: as cache=False
            assert hmp.cache_bytes() == 0
    with torch.no_grad():  # a region over a loop (generate()): a weight's second use shows it, kept from there
        assert [casts(model, x) for _ in range(4)] == [5, 5, 1, 1]
        assert hmp.cache_bytes() == copies
    with torch.no_grad():  # the next region keeps from the first use: each weight cast once
        assert [casts(model, x) for _ in range(3)] == [5, 1, 1]
    with torch.no_grad():  # a region that casts no weight (an EMA update, a metric) changes nothing
        (x * 2).sum()
    with torch.no_grad():
        assert [casts(model, x) for _ in range(2)] == [5, 1]
    assert _free_pages_touched(model, x, torch.no_grad) == copies  # this one-forward region kept, and paid nothing
    assert _free_pages_touched(model, x, torch.no_grad) == 0  # so the next does not keep
    hmp.clear_cache()  # clear_cache() (and convert()) start over: the next region keeps from the first use
    with torch.no_grad():
        assert [casts(model, x) for _ in range(2)] == [5, 1]


def test_a_one_forward_region_computes_what_cache_off_computes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    xs = [torch.randn(2, 8) for _ in range(4)]
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def run(**options):
        model.load_state_dict(start)
        with hmp.converted(**options):
            out = []
            for x in xs:
                with torch.no_grad():
                    out.append(model(x))
                with torch.no_grad():
                    out += [model(x), model(x)]
                with torch.no_grad():
                    model[0].weight.mul_(0.9)  # a write inside a region between two uses (seen through the counter)
                    out.append(model(x))
            return out

    assert all(torch.equal(a, b) for a, b in zip(run(), run(cache=False)))


def test_grad_turned_off_by_a_call_keeps_nothing():
    """Not a block: nothing says where it ends, so no-grad calls cast each time, as before."""
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    torch.set_grad_enabled(False)
    try:
        assert [casts(lin, x) for _ in range(3)] == [3, 3, 3]
    finally:
        torch.set_grad_enabled(True)


def test_frozen_weights_keeps_its_copies_across_regions():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with hmp.frozen_weights():
        for expected in (3, 1, 1):
            with torch.no_grad():  # one region per batch: the block's copies serve every one
                assert casts(lin, x) == expected
        assert cache.size() == 2
    assert cache.size() == 0
    with torch.no_grad(), hmp.frozen_weights():  # the block inside a region: its own, then the region's
        assert casts(lin, x) == 3
    with torch.no_grad():
        assert casts(lin, x) == 3


def test_memory_is_one_copy_per_weight_and_goes_with_the_weight():
    hmp.convert()
    layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(5):
            layers(x)
        assert cache.size() == 8  # four weights, four biases: however many calls
        layers[0] = torch.nn.Linear(8, 8)  # the old layer's weights die: their copies with them
        gc.collect()
        assert cache.size() == 6
        layers(x)
        assert cache.size() == 8  # the new layer's first use keeps its copies


def _bf16_bytes(model):
    return sum(p.numel() * 2 for p in model.parameters())


@pytest.mark.parametrize("release", ["to(bfloat16)", "offload", "del"])
def test_a_region_never_keeps_storage_the_program_released(release):
    """After the region kept its copies, the program lets the float32 weights go (``model.to``,
    offloading through ``p.data = ...``, deleting the model): their storage is freed at once, and
    the copies with it; hmp.cache_bytes() says what is kept, in bytes."""
    hmp.convert()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    x = torch.randn(2, 64)
    storages = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
    with torch.no_grad():
        assert hmp.cache_bytes() == 0
        model(x)
        assert hmp.cache_bytes() == _bf16_bytes(model)  # a bf16 copy of each weight and bias, from the first use
        if release == "to(bfloat16)":
            model.to(torch.bfloat16)
        elif release == "offload":  # what .to(device) does to each parameter (set_data)
            for p in model.parameters():
                p.data = torch.empty_like(p)  # (another device's memory in a real offload)
        else:
            del model
        gc.collect()
        assert all(s() is None for s in storages)  # the float32 storage is freed inside the region
        assert hmp.cache_bytes() == 0


def test_cache_bytes_counts_regions_frozen_blocks_and_held_copies():
    hmp.convert()
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x), model(x)
        assert hmp.cache_bytes() == _bf16_bytes(model)
    assert hmp.cache_bytes() == 0
    model.requires_grad_(False)
    with torch.no_grad():
        model(x), model(x)
        assert hmp.cache_bytes() == 0  # frozen weights: cast per call
    with hmp.frozen_weights():
        model(x)
        assert hmp.cache_bytes() == _bf16_bytes(model)  # the promise: kept from the first use
    model.requires_grad_(True)
    out = model(x)
    assert hmp.cache_bytes() == _bf16_bytes(model)  # the graph holds them until backward (autograd saves the weights')
    out.float().sum().backward()
    assert hmp.cache_bytes() == 0


def test_each_thread_has_its_own_region():
    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    seen = {}

    def other():
        torch.set_grad_enabled(False)  # no region in this thread
        seen["outside"] = [casts(lin, x) for _ in range(2)]
        torch.set_grad_enabled(True)
        with torch.no_grad():
            seen["inside"] = [casts(lin, x) for _ in range(3)]

    with torch.no_grad():
        assert [casts(lin, x) for _ in range(2)] == [3, 1]
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert casts(lin, x) == 1
    assert seen == {"outside": [3, 3], "inside": [3, 1, 1]}


def test_a_region_whose_exit_hmp_does_not_see_keeps_nothing():
    """revert() inside a region: torch's own exit closes the block; the copies go with it, and
    a later conversion keeps nothing for no-grad calls outside a region."""
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    hmp.convert()
    with torch.no_grad():
        lin(x)
        copy = weakref.ref(cache.caster(BF16).any(lin.weight))
        hmp.revert()
    gc.collect()
    assert copy() is None
    hmp.convert()
    torch.set_grad_enabled(False)
    try:
        assert [casts(lin, x) for _ in range(2)] == [3, 3]
    finally:
        torch.set_grad_enabled(True)


def test_grad_mode_blocks_are_torchs_own_after_revert():
    from torch.autograd import grad_mode

    blocks = (grad_mode.no_grad, grad_mode.inference_mode, grad_mode.set_grad_enabled)
    before = [(cls.__dict__["__enter__"], cls.__dict__["__exit__"]) for cls in blocks]
    hmp.convert()
    assert all(cls.__dict__["__enter__"] is not enter for cls, (enter, _) in zip(blocks, before))
    hmp.revert()
    assert [(cls.__dict__["__enter__"], cls.__dict__["__exit__"]) for cls in blocks] == before


def test_a_region_block_still_does_what_torchs_does():
    hmp.convert()
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert not torch.is_grad_enabled() and not (x * 2).requires_grad
    assert torch.is_grad_enabled()
    with torch.inference_mode():
        assert torch.is_inference_mode_enabled() and (x * 2).is_inference()
    with torch.set_grad_enabled(False):
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    with pytest.raises(ValueError), torch.no_grad():
        raise ValueError("the block's exit runs on an exception")
    assert torch.is_grad_enabled() and cache.size() == 0


# -- never a stale copy: against cache=False -------------------------------------------------------


def _seen_write(kind, model, opts, x):
    """A write hmp sees inside a no-grad region (also: inside inference_mode, the first four)."""
    p = model.emb
    if kind == "mul_":
        p.mul_(0.9)
    elif kind == "copy_":
        p.copy_(torch.randn_like(p))
    elif kind == "refill":  # FSDP2's copy-out: a write, and the version counter put back
        with torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(torch.randn_like(p))
    elif kind == "load_state_dict":
        model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
    elif kind == "load_state_dict_assign":  # new parameter objects
        model.load_state_dict({k: v.clone() - 0.01 for k, v in model.state_dict().items()}, assign=True)
        for o in opts.values():  # the optimizers follow the new parameters
            o.param_groups[0]["params"] = list(model.parameters())
    elif kind == "data_assign":
        p.data = torch.randn_like(p)
    elif kind == "data_transposed":  # the square weight's memory, read the other way: no counter, same pointer
        model.mid.weight.data = model.mid.weight.data.t()
    elif kind == "refill_freed":  # FSDP2's reshard and unshard
        storage = p.untyped_storage()
        size, new = storage.nbytes(), torch.randn_like(p)
        storage.resize_(0)
        storage.resize_(size)
        with torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(new)
    elif kind.startswith("step_"):  # an optimizer step inside the region
        for q in model.parameters():
            q.grad = torch.full_like(q, 0.5)
        opts[kind[5:]].step()
    elif kind == "backward_then_data":  # a hand-written update after a backward, through the alias
        with torch.enable_grad():
            model(x).float().pow(2).sum().backward()
        for q in model.parameters():
            q.data -= 0.1 * q.grad
            q.grad = None
    else:
        raise AssertionError(kind)


INFERENCE_SAFE = ["mul_", "copy_", "refill", "load_state_dict"]
SEEN = INFERENCE_SAFE + [
    "load_state_dict_assign",
    "data_assign",
    "data_transposed",
    "refill_freed",
    "step_fused",
    "step_foreach",
    "step_single",
    "backward_then_data",
]
# writes no counter shows: seen between regions; inside one, seen for frozen weights (never kept outside
# frozen_weights()), not for a trainable weight the region kept (nor inside frozen_weights())
ALIAS = ["data_inplace", "data_copy", "storage_copy"]
REGIONS = ["no_grad", "inference_mode", "set_grad_enabled", "decorated", "nested", "frozen_per_region"]


def _alias_write(kind, model):
    if kind == "data_inplace":  # peft's merge_adapter(): base_layer.weight.data += delta
        model.emb.data.mul_(-1)
    elif kind == "data_copy":
        model.mid.weight.data.copy_(torch.randn_like(model.mid.weight))
    else:  # a loader or an offload writing the memory under the weight
        w = model.mid.weight
        w.untyped_storage().copy_(torch.randn_like(w).untyped_storage())


def _region(kind, body):
    if kind == "no_grad":
        with torch.no_grad():
            return body()
    if kind == "inference_mode":
        with torch.inference_mode():
            return [t.clone() for t in body()]
    if kind == "set_grad_enabled":
        with torch.set_grad_enabled(False):
            return body()
    if kind == "decorated":
        return torch.no_grad()(body)()
    if kind == "nested":  # generate() inside an evaluation loop's region
        with torch.no_grad():
            return torch.no_grad()(body)()
    if kind == "frozen_per_region":  # frozen_weights() around one region: its stores serve
        with hmp.frozen_weights(), torch.no_grad():
            return body()
    raise AssertionError(kind)


def _run(program, use_cache, frozen=False):
    model, opts, x = tied_training()
    model.requires_grad_(not frozen)
    outs = []
    hmp.convert(cache=use_cache)
    try:
        for between, kind, writes in program:
            if between is not None:
                _alias_write(between, model)
            steps = ["call"]
            for write in writes:  # every write between two calls of the region
                steps += [write, "call"]

            def body(steps=steps, kind=kind):
                got = []
                for step in steps:
                    if step == "call":
                        got.append(model(x))
                    elif kind == "frozen_per_region" and step not in INFERENCE_SAFE:
                        continue  # frozen_weights() is the promise that nothing else writes
                    elif step in ALIAS:
                        if frozen:  # a frozen weight: no copy is kept, so the write is seen
                            _alias_write(step, model)
                    elif frozen and step == "backward_then_data":
                        continue  # nothing requires grad
                    else:
                        _seen_write(step, model, opts, x)
                return got

            if kind == "inference_mode":
                steps = [s for s in steps if s == "call" or s in INFERENCE_SAFE or (frozen and s in ALIAS)]
            outs.extend(_region(kind, lambda steps=steps, body=body: body(steps)))
    finally:
        hmp.revert()
    return outs


# regions, each: a write before it (or none), its kind, the writes between its calls
_WRITES = st.lists(st.sampled_from(SEEN + ALIAS), max_size=3)
_REGION = st.tuples(st.none() | st.sampled_from(ALIAS), st.sampled_from(REGIONS), _WRITES)
_PROGRAM = st.lists(
    _REGION,
    min_size=1,
    max_size=4,
)


@settings(deadline=None, max_examples=60)
@given(program=_PROGRAM, frozen=st.booleans())
def test_a_region_computes_exactly_what_cache_off_computes(program, frozen):
    """Writes through the weight, refills, optimizer steps between two calls of a region; writes
    through ``p.data`` and the storage before regions, and inside them where the weights are frozen."""
    with_cache, without = _run(program, True, frozen), _run(program, False, frozen)
    assert len(with_cache) == len(without)
    for a, b in zip(with_cache, without):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("write", SEEN)
def test_every_seen_write_between_two_calls_of_one_region(write):
    """Each write once, deterministically, between two calls inside one region (the hypothesis
    test above mixes them)."""
    program = [(None, "no_grad", [write])]
    with_cache, without = _run(program, True), _run(program, False)
    assert all(torch.equal(a, b) for a, b in zip(with_cache, without))
    assert not torch.equal(with_cache[0], with_cache[1])  # the write changed what the model computes


def _alias(write, lin):
    alias = lin.weight.data  # another tensor on the weight's memory, with a counter of its own
    alias.mul_(-1) if write == "mul_" else alias.copy_(torch.randn_like(alias))


def _fresh(lin, x):
    with hmp.converted(cache=False), torch.no_grad():
        return lin(x)


@pytest.mark.parametrize("write", ["mul_", "copy_"])
def test_an_alias_write_is_missed_only_inside_a_region_that_kept_a_trainable_weight(write):
    """What docs/performance.md says: a write through ``p.data`` inside a region is not seen once the
    region keeps the weight's copy (a weight that requires grad, from its first use: as inside
    torch.autocast's region); between regions it is."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    hmp.convert()
    with torch.no_grad():
        before = lin(x)
        lin(x)  # a second use: still the kept copy
        _alias(write, lin)
        inside = lin(x)
    with torch.no_grad():
        after = lin(x)
    assert torch.equal(inside, before)  # the region's copy: the write is not seen inside it
    assert torch.equal(after, _fresh(lin, x)) and not torch.equal(after, before)


def _load_candidate(how, model, vector, buffer):
    """Evolution strategies, a line search: a candidate's parameters put into the model inside the
    no-grad block that scores it."""
    if how == "vector_to_parameters, new vector":  # a new tensor per candidate: its memory is new
        torch.nn.utils.vector_to_parameters(vector.clone(), model.parameters())
    elif how == "vector_to_parameters, one buffer":  # p.data = a view of the same buffer: nothing moves
        buffer.copy_(vector)
        torch.nn.utils.vector_to_parameters(buffer, model.parameters())
    else:  # "p.data.copy_()": through the alias, whose version counter is not the parameter's
        i = 0
        for p in model.parameters():
            p.data.copy_(vector[i : i + p.numel()].view_as(p))
            i += p.numel()


@pytest.mark.parametrize(
    "how", ["vector_to_parameters, new vector", "vector_to_parameters, one buffer", "p.data.copy_()"]
)
def test_candidates_loaded_inside_one_region_are_seen_or_need_clear_cache(how):
    """What docs/performance.md and README say: candidates loaded inside one no-grad block through memory
    the parameters already had (one buffer, ``p.data.copy_()``) move no counter hmp can read, so the
    region's copies of the first candidate serve the others until ``hmp.clear_cache()`` after each
    load (or ``convert(cache=False)``); a load that gives the parameters new memory is seen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8)
    base = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    candidates = [base + 0.5 * torch.randn_like(base) for _ in range(4)]

    def scores(clear=False, **options):
        torch.nn.utils.vector_to_parameters(base.clone(), model.parameters())
        buffer = base.clone()
        with hmp.converted(**options), torch.no_grad():
            out = []
            for vector in candidates:
                _load_candidate(how, model, vector, buffer)
                if clear:
                    hmp.clear_cache()
                out.append(model(x))
            return out

    truth = scores(cache=False)
    assert all(torch.equal(a, b) for a, b in zip(scores(clear=True), truth))
    got = scores()
    if how == "vector_to_parameters, new vector":
        assert all(torch.equal(a, b) for a, b in zip(got, truth))
    else:  # the limit: every candidate after the first scored as the first
        assert torch.equal(got[0], truth[0]) and all(torch.equal(g, got[0]) for g in got[1:])


@pytest.mark.parametrize("write", ["mul_", "copy_"])
def test_an_alias_write_inside_a_region_to_a_frozen_weight_is_seen(write):
    """A frozen weight (requires_grad=False: peft's base layers, a diffusers pipeline) is never kept
    outside frozen_weights(), so every write to it is seen (peft's merge_adapter() writes
    ``base_layer.weight.data``)."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    lin.requires_grad_(False)
    hmp.convert()
    with torch.no_grad():
        before = [lin(x) for _ in range(3)]
        assert cache.size() == 0  # no copy kept: frozen
        _alias(write, lin)
        inside = lin(x)
        assert torch.equal(inside, _fresh(lin, x)) and not torch.equal(inside, before[0])


# -- torch.compile and the region ------------------------------------------------------------------


@needs("traced_state_writes")  # below it the graph breaks at each change of hmp's thread state
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_code_with_a_region_inside_compiles_once_and_equals_eager():
    import torch._dynamo.testing

    hmp.convert()
    lin = torch.nn.Linear(8, 8)
    xs = [torch.randn(2, 8) for _ in range(3)]

    def f(x):
        with torch.no_grad():
            return lin(x) * 2

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(f, backend=counter)
    outs = [compiled(x) for x in xs]
    assert counter.frame_count == 1
    with torch.no_grad():  # a region around compiled calls: the cache steps aside while compiled code runs
        outs += [compiled(x) for x in xs]
    eager = [f(x) for x in xs] * 2
    assert all(a.dtype == BF16 and torch.equal(a, b) for a, b in zip(outs, eager))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_refill_in_compiled_code_is_missed_only_out_of_reach_where_a_region_kept_the_copy(frozen):
    """A refill (a write with the version counter put back: FSDP2's all-gather) is seen through
    torch's Python function, or by the version counter where a compiled graph does not put it back.
    A graph compiled by a backend that keeps the call (``backend="eager"``) runs the function dynamo
    captured, torch's or hmp's, depending on what the process compiled first (measured: missed when
    this test runs alone, seen after another test compiled a refill under hmp): inside a region that
    kept a trainable weight's copy that refill may be missed until the region ends, as under
    torch.autocast, which misses every refill; a frozen weight's copy is never kept there, so it is
    seen; after the region it is seen."""
    torch.manual_seed(0)
    lin, x, new = torch.nn.Linear(8, 8), torch.randn(2, 8), torch.randn(8, 8)
    lin.requires_grad_(not frozen)

    @torch.compile(backend="eager", fullgraph=True)
    def refill(p, src):
        with torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(src)

    with torch.no_grad():
        refill(lin.weight, lin.weight.clone())  # compiled before convert()
    hmp.convert()
    with torch.no_grad():
        before = lin(x)
        lin(x)  # a trainable weight's copy is kept from its first use
        refill(lin.weight, new)
        inside = lin(x)
    with torch.no_grad():
        after = lin(x)
    fresh = _fresh(lin, x)
    assert torch.equal(after, fresh) and not torch.equal(after, before)
    if frozen:
        assert torch.equal(inside, fresh)
    else:  # the region's copy or the refilled weight's: nothing else
        assert torch.equal(inside, before) or torch.equal(inside, fresh)


def test_the_cache_section_of_the_docs_names_tests_that_exist():
    """docs/performance.md's cache section backs each sentence with a test, named ``cache::test_...``
    (test_cache.py), ``regions::test_...`` (this file), ``accumulation::test_...``
    (test_accumulation.py) or ``activations::test_...`` (test_activation_casts.py): each one exists."""
    here = pathlib.Path(__file__).parent
    docs = (here.parents[2] / "docs" / "performance.md").read_text()
    section = docs[docs.index("## The weight-cast cache") :]
    section = section[: section.index("\n## ", 1)]
    named = re.findall(r"\b(cache|regions|accumulation|activations)::(test_\w+)", section)
    assert len(named) >= 15
    files = {"cache": "core/test_cache.py", "regions": "rules/test_no_grad_regions.py"}
    files |= {"accumulation": "core/test_accumulation.py", "activations": "core/test_activation_casts.py"}
    for where, name in named:
        assert f"def {name}(" in (here.parent / files[where]).read_text(), (where, name)
