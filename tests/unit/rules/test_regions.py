"""What hmp leaves alone (docs/leaves-alone.md): torch.autocast regions,
backward, GradScaler's arithmetic and DataLoader data loading."""

import contextlib
import multiprocessing
import pkgutil
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import release_said
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.core import state

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

pytestmark = [
    pytest.mark.usefixtures("one_intra_op_thread"),
    pytest.mark.filterwarnings("ignore:hmp. a torch.autocast region"),
    pytest.mark.filterwarnings("ignore:`torch.(cuda|cpu).amp.autocast"),
]


def dot_dtype():
    """``dot`` is in hmp's BF16 list and in none of torch.autocast's CPU lists:
    bf16 exactly when hmp casts here."""
    return torch.dot(torch.ones(2), torch.ones(2)).dtype


# -- torch.autocast regions ---------------------------------------------------------------


@pytest.mark.slow  # importing transformers
def test_llama_rotary_embedding_at_2048_positions_is_fp32_bit_for_bit():
    LlamaConfig = pytest.importorskip("transformers").LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=4096)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(1, 2048, 128)
    positions = torch.arange(2048)[None]
    want_cos, want_sin = rotary(x, positions)
    hmp.convert()
    assert (x @ torch.randn(128, 4)).dtype == BF16  # hmp is on outside the model's fp32 region
    cos, sin = rotary(x, positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize(
    "region",
    [
        lambda: torch.autocast("cpu", enabled=False),
        lambda: torch.autocast("cuda", enabled=False),  # the device_type does not matter
        lambda: torch.amp.autocast("cpu", dtype=BF16, enabled=False),
        lambda: torch.cuda.amp.autocast(enabled=False),
        lambda: torch.cpu.amp.autocast(enabled=False),
        lambda: torch.autocast("cpu", dtype=BF16),  # enabled: autocast's rules, not hmp's
    ],
    ids=["cpu", "cuda", "amp", "cuda.amp", "cpu.amp", "enabled"],
)
def test_no_casts_inside_any_autocast_region(region):
    hmp.convert()
    with region():
        assert dot_dtype() == FP32 and not hmp.casts_enabled()
    assert dot_dtype() == BF16


def test_decorator_and_exceptions_restore_the_state():
    hmp.convert()

    @torch.autocast("cpu", enabled=False)
    def fp32_block(fail):
        if fail:
            raise ValueError("inside")
        return dot_dtype()

    assert fp32_block(False) == FP32
    with pytest.raises(ValueError):
        fp32_block(True)
    assert hmp.casts_enabled() and dot_dtype() == BF16


def test_a_region_entered_before_convert_or_left_after_revert_leaves_the_state_alone():
    region = torch.autocast("cpu", enabled=False)
    region.__enter__()
    hmp.convert()
    region.__exit__(None, None, None)  # entered unconverted: nothing to undo
    assert hmp.casts_enabled() and dot_dtype() == BF16
    with torch.autocast("cpu", enabled=False):
        hmp.revert()  # the region stops counting for this thread
    hmp.convert()
    assert hmp.casts_enabled() and dot_dtype() == BF16


def test_generators_interleaving_regions_and_disable_casts():
    hmp.convert()

    def fp32_steps():
        with torch.autocast("cpu", enabled=False):
            yield dot_dtype()
            yield dot_dtype()

    gen = fp32_steps()
    assert next(gen) == FP32
    blocks = hmp.disable_casts()
    blocks.__enter__()
    assert next(gen) == FP32
    gen.close()  # leaves the region while the caller's disable_casts is still open
    assert not hmp.casts_enabled()
    blocks.__exit__(None, None, None)
    assert hmp.casts_enabled() and dot_dtype() == BF16


# Oracle: hmp casts exactly when no autocast region and no disable_casts
# block is open in this thread; leaving everything restores casting.
_BLOCKS = st.sampled_from(["off", "on", "disable", "decorated", "raise"])


@settings(deadline=None)
@given(st.lists(st.lists(_BLOCKS, min_size=1, max_size=4), min_size=1, max_size=4))
def test_nesting_property(programs):
    hmp.convert()

    def enter(stack, depth):
        if depth == len(stack):
            assert dot_dtype() == (FP32 if stack else BF16)
            return
        block = stack[depth]
        ctx = {
            "off": lambda: torch.autocast("cpu", enabled=False),
            "on": lambda: torch.autocast("cpu", dtype=BF16),
            "disable": hmp.disable_casts,
        }.get(block)
        if block == "decorated":
            torch.autocast("cpu", enabled=False)(enter)(stack, depth + 1)
        elif block == "raise":
            with contextlib.suppress(KeyError):
                with torch.autocast("cpu", enabled=False):
                    enter(stack, depth + 1)
                    raise KeyError
        else:
            with ctx():
                enter(stack, depth + 1)
        assert dot_dtype() == (FP32 if depth else BF16)

    for stack in programs:
        enter(stack, 0)
    assert hmp.casts_enabled() and state.tls.off == 0


def test_compiled_function_with_a_disabled_region_is_one_graph(fresh_dynamo):
    hmp.convert()

    def f(a, b):
        with torch.autocast("cpu", enabled=False):
            inner = a @ b
        return a @ b, inner

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        outer, inner = compiled(a, b)
        assert (outer.dtype, inner.dtype) == (BF16, FP32)
        assert hmp.casts_enabled()


def test_compiled_function_with_a_graph_break_inside_a_disabled_region(fresh_dynamo):
    hmp.convert()

    def f(a, b):
        with torch.autocast("cpu", enabled=False):
            before = a @ b
            torch._dynamo.graph_break()
            after = a @ b
        return before, after, a @ b

    compiled = torch.compile(f, backend="eager")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        assert [t.dtype for t in compiled(a, b)] == [FP32, FP32, BF16]
        assert hmp.casts_enabled()


def test_scripted_autocast_region_still_scripts():
    hmp.convert()

    @torch.jit.script
    def f(a, b):
        with torch.autocast("cpu", enabled=False):
            return a @ b

    assert f(torch.randn(2, 2), torch.randn(2, 2)).dtype == FP32
    assert hmp.casts_enabled()


# -- backward -----------------------------------------------------------------------------


def test_tensor_hook_arithmetic_sees_no_casts():
    hmp.convert()
    p = torch.nn.Parameter(torch.randn(4, 4))
    seen = []
    p.register_hook(lambda g: seen.append(hmp.casts_enabled()) or g * 0.5)
    (torch.randn(2, 4) @ p).sum().backward()
    assert seen == [False] and p.grad.dtype == FP32
    assert hmp.casts_enabled()


def test_full_backward_hook_scaling_grad_input():
    hmp.convert()
    layer = torch.nn.Linear(4, 4)
    layer.register_full_backward_hook(lambda m, gin, gout: tuple(g * 0.5 for g in gin))
    x = torch.randn(3, 4, requires_grad=True)
    layer(x).float().sum().backward()
    with hmp.disable_casts():
        want = (torch.ones(3, 4) @ layer.weight.detach().bfloat16().float()) * 0.5
    assert x.grad.dtype == FP32
    torch.testing.assert_close(x.grad, want, atol=1e-2, rtol=1e-2)


class _MatmulInBackward(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x @ w).float()  # bf16 under hmp; the gradient coming back is fp32

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx, gw = grad @ w.t(), x.t() @ grad
        _MatmulInBackward.seen.append((gx.dtype, gw.dtype, hmp.casts_enabled()))
        return gx, gw


def test_custom_function_backward_and_torch_autograd_grad_imported_before_convert():
    from torch.autograd import grad  # bound before convert(): still reaches hmp's switch

    hmp.convert()
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    _MatmulInBackward.seen.clear()
    _MatmulInBackward.apply(x, w).sum().backward()
    (gx,) = grad(_MatmulInBackward.apply(x, w).sum(), [x])
    assert _MatmulInBackward.seen == [(FP32, FP32, False)] * 2
    with hmp.disable_casts():
        assert torch.equal(gx, torch.ones(3, 2) @ w.detach().t())
    assert hmp.casts_enabled()


def test_a_thread_first_seen_inside_backward_starts_with_casts_off():
    # CPU backward runs on the calling thread, so the engine's device threads
    # (CUDA) cannot be run here: this checks the rule they start from.
    hmp.convert()
    fresh = []
    p = torch.nn.Parameter(torch.randn(2))
    p.register_hook(lambda g: fresh.append(type(state.tls)().off) or g)
    p.sum().backward()
    assert fresh == [1] and type(state.tls)().off == 0
    outside = []
    thread = threading.Thread(target=lambda: outside.append(state.tls.off))
    thread.start()
    thread.join()
    assert outside == [0]


# -- GradScaler ---------------------------------------------------------------------------


def _scale_trajectory(mode, steps=12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    region = (lambda: torch.autocast("cpu", dtype=FP16)) if mode == "autocast" else contextlib.nullcontext
    if mode == "hmp":
        hmp.convert(low_precision_type=FP16)
    scales = []
    for _ in range(steps):
        opt.zero_grad()
        with region():
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    hmp.revert()
    return scales


def test_grad_scaler_scale_trajectory_matches_torch_autocast():
    want = _scale_trajectory("autocast")
    assert max(want) > 65504  # the scale outgrows fp16 here
    assert _scale_trajectory("hmp") == want


def test_grad_scaler_arithmetic_is_uncast():
    hmp.convert(low_precision_type=FP16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss).item() == 3.0 * 2**20  # fp16 would be inf
    assert hmp.casts_enabled()


# -- DataLoader ---------------------------------------------------------------------------


class Probe(torch.utils.data.Dataset):
    """Each item: what hmp does where the item is loaded."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return {
            "dot": torch.dot(torch.ones(2), torch.ones(2)).dtype == BF16,
            "converted": hmp.is_converted(),
            "casts": hmp.casts_enabled(),
        }


def convert_in_worker(worker_id):
    hmp.convert()  # a worker that converts (a script converting at import, re-run by spawn) still casts nothing


def _load(**kwargs):
    loader = torch.utils.data.DataLoader(Probe(), batch_size=None, **kwargs)
    return list(loader)


@pytest.mark.parametrize(
    "method", ["fork", pytest.param("spawn", marks=[pytest.mark.slow, pytest.mark.torch_internals])]
)  # spawn imports torch
def test_dataloader_workers_never_cast(method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} here")
    hmp.convert()
    context = multiprocessing.get_context(method)
    items = _load(num_workers=1, multiprocessing_context=context, worker_init_fn=convert_in_worker)
    assert items == [{"dot": False, "converted": True, "casts": False}] * 2
    assert hmp.casts_enabled() and dot_dtype() == BF16


def test_a_worker_finds_its_entry_point_by_name_and_it_reaches_torchs_loop():
    from multiprocessing.reduction import ForkingPickler

    from torch.utils.data._utils import worker

    from hmp.core.identity import unwrap
    from hmp.rules import regions

    loop = worker._worker_loop
    hmp.convert()
    hmp.convert(opt_level="O2")  # re-configuring while converted still finds torch's loop
    assert worker._worker_loop is regions.worker_loop and unwrap(regions.worker_loop) is loop
    # spawn and forkserver send it by this name; the worker imports the same hmp
    assert ForkingPickler.loads(bytes(ForkingPickler.dumps(worker._worker_loop))) is regions.worker_loop
    assert pkgutil.resolve_name("hmp.rules.regions:worker_loop") is regions.worker_loop


def test_in_process_data_loading_never_casts():
    hmp.convert()
    assert _load(num_workers=0) == [{"dot": False, "converted": True, "casts": False}] * 2
    assert hmp.casts_enabled()


def test_entering_an_enabled_region_warns_once_and_an_error_filter_changes_nothing(monkeypatch):
    monkeypatch.setattr(state, "warned", release_said())
    hmp.convert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="hmp casts nothing inside torch.autocast regions"):
            with torch.autocast("cpu", dtype=BF16):
                pass  # not reached
        assert not torch.is_autocast_enabled("cpu") and hmp.casts_enabled()
    monkeypatch.setattr(state, "warned", release_said())
    with pytest.warns(UserWarning, match=r"\(cpu, bfloat16\).*once per process"):
        with torch.autocast("cpu", dtype=BF16):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=BF16):  # second time: silent
            assert dot_dtype() == FP32


def test_revert_puts_every_region_patch_back():
    from torch.amp.autocast_mode import autocast
    from torch.utils.data import dataloader
    from torch.utils.data._utils import worker

    owners = [
        autocast,
        torch.autograd,
        torch.autograd.graph,
        torch.amp.GradScaler,
        worker,
        dataloader._SingleProcessDataLoaderIter,
    ]
    before = [dict(vars(o)) for o in owners]
    hmp.convert()
    assert autocast.__dict__["__enter__"] is not before[0]["__enter__"]
    assert worker._worker_loop is not before[4]["_worker_loop"]
    hmp.convert(opt_level="O2")  # re-configuring never wraps a wrapper
    assert autocast.__enter__.__hmp_original__ is before[0]["__enter__"]
    hmp.revert()
    for owner, saved in zip(owners, before):
        now = vars(owner)
        assert now.keys() == saved.keys() and all(now[k] is saved[k] for k in saved), owner
