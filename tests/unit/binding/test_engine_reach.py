"""engine="autocast" gives what engine="python" gives where autocast would act unasked
(docs/engines.md): on float16 and mixed inputs of listed ops, inside composites in no list
whose kernels call ops autocast casts, in fused fast paths, and after revert() in another
thread. tests/property/test_engines_agree.py sweeps every OpInfo op; these are the cases
issue 78 found, fast."""

import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp
from hmp.binding import autocast_reach
from hmp.core import torch_private

H16, B16, F32 = torch.float16, torch.bfloat16, torch.float32


def _r(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# float16 and mixed inputs of listed ops: hmp's rule keeps a float16 tensor (it casts float32 only),
# autocast would cast it; autocast's promotion raises on float16 beside bfloat16
MIXED_CALLS = {
    "cat fp16+fp16": lambda: torch.cat([_r(2, 3, dtype=H16), _r(2, 3, dtype=H16, seed=1)]),
    "cat bf16+fp16": lambda: torch.cat([_r(2, 3, dtype=B16), _r(2, 3, dtype=H16, seed=1)]),
    "stack fp16+fp32": lambda: torch.stack([_r(2, 3, dtype=H16), _r(2, 3, seed=1)]),
    "linear fp16 x, fp32 w": lambda: F.linear(_r(4, 8, dtype=H16), _r(5, 8, seed=1)),
    "mm fp16": lambda: torch.mm(_r(4, 8, dtype=H16), _r(8, 5, dtype=H16, seed=1)),
    "conv2d fp16 x, fp32 w": lambda: F.conv2d(_r(1, 3, 8, 8, dtype=H16), _r(4, 3, 3, 3, seed=1)),
    "baddbmm fp16": lambda: torch.baddbmm(*(_r(1, 2, 2, dtype=H16, seed=i) for i in range(3))),
    "matmul fp64 x fp32": lambda: torch.matmul(_r(3, 4, dtype=torch.float64), _r(4, 2, seed=1)),
}
# composites in no list whose kernels call an op autocast casts
F32_THETA = torch.tensor([[[0.9, -0.2, 0.1], [0.15, 1.1, -0.05]]])
COMPOSITES = {
    "spatial transformer": lambda: F.grid_sample(
        _r(1, 3, 16, 16), F.affine_grid(F32_THETA, (1, 3, 16, 16), align_corners=False), align_corners=False
    ),
    "cov": lambda: torch.cov(_r(6, 64) + 5),
    "corrcoef": lambda: torch.corrcoef(_r(6, 64) + 5),
    "hstack fp16": lambda: torch.hstack([_r(2, 3, dtype=H16), _r(2, 3, dtype=H16, seed=1)]),
    "cartesian_prod fp16": lambda: torch.cartesian_prod(_r(3, dtype=H16), _r(2, dtype=H16, seed=1)),
}
# a spelling of a listed op (mm): cast on both engines, by hmp's wrapper
SPELLED = {"multi_dot": lambda: torch.linalg.multi_dot([_r(3, 4), _r(4, 5, seed=1), _r(5, 2, seed=2)])}


def _both(call, **convert_kwargs):
    out = {}
    for engine in ("python", "autocast"):
        with hmp.converted(engine=engine, **convert_kwargs), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out[engine] = call()
            except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
                out[engine] = type(e)
    return out["python"], out["autocast"]


def _equal(a, b):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(MIXED_CALLS))
def test_float16_and_mixed_inputs_give_the_same_on_both_engines(name):
    ours, theirs = _both(MIXED_CALLS[name])
    assert _equal(ours, theirs), (getattr(ours, "dtype", ours), getattr(theirs, "dtype", theirs))
    assert isinstance(ours, torch.Tensor) or name.startswith("matmul fp64")  # torch's mm refuses float64 with bf16


@pytest.mark.parametrize("name", sorted(COMPOSITES) + sorted(SPELLED))
def test_composites_in_no_list_run_as_torchs_on_both_engines(name):
    call = COMPOSITES.get(name) or SPELLED[name]
    ours, theirs = _both(call)
    assert _equal(ours, theirs)
    assert _equal(ours, call()) if name in COMPOSITES else ours.dtype == torch.bfloat16


def test_what_autocast_acts_on_is_found_from_the_registry():
    """No name is listed by hand: cov's kernel reaches mm, affine_grid_generator's reaches a batched
    product, each found by tracing them; the hot ops of a transformer reach none and keep torch's own
    function under the engine (no wrapper, no frame)."""
    reached = autocast_reach.reached()
    assert "mm" in reached["cov"]
    assert reached["affine_grid_generator"] & {"bmm", "matmul", "baddbmm"}
    acted = autocast_reach.acted_on(("cpu",))
    assert torch_private.autocast_kernels("cpu") <= acted
    assert {"cov", "corrcoef", "affine_grid_generator", "hstack", "tensordot"} <= acted
    quiet = ("reshape", "layer_norm", "gelu", "silu", "embedding", "dropout", "softmax", "mean", "transpose")
    assert not acted & set(quiet)
    originals = {n: getattr(torch, n) for n in ("reshape", "relu", "dropout", "transpose", "flatten")}
    with hmp.converted(engine="autocast"):
        assert all(getattr(torch, n) is fn for n, fn in originals.items())


@pytest.mark.parametrize("fast", ["TransformerEncoderLayer", "MultiheadAttention"])
def test_fused_fast_paths_follow_the_lists_that_hold_their_parts(fast, tmp_path):
    """Eval under no_grad takes torch's fused kernels, which hold linear: with a BF16 list without
    linear they run in float32 on both engines, with the default lists as hmp's linear says on both."""
    torch.manual_seed(0)
    layer = (
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        if fast == "TransformerEncoderLayer"
        else nn.MultiheadAttention(32, 4, batch_first=True)
    ).eval()
    x = torch.randn(2, 6, 32)

    def run():
        with torch.no_grad():
            out = layer(x) if fast == "TransformerEncoderLayer" else layer(x, x, x, need_weights=False)[0]
        return out

    no_linear = tmp_path / "bf16.txt"
    no_linear.write_text("include default\n-linear\n")
    plain = run()
    ours, theirs = _both(run, bf16_file_path=no_linear)
    assert _equal(ours, plain) and _equal(theirs, plain)
    ours, theirs = _both(run)
    assert _equal(ours, theirs)


def test_revert_in_another_thread_leaves_the_main_thread_as_before():
    """The converting (main) thread departs at its next bytecode after another thread's revert():
    nothing hmp turned on stays on; what it had before convert() is back."""
    assert threading.current_thread() is threading.main_thread()
    found = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    hmp.convert(engine="autocast")
    t = threading.Thread(target=hmp.revert)
    t.start()
    t.join()
    assert not hmp.is_converted()
    assert lin(x).dtype == torch.mm(x, x.t()).dtype == torch.float32
    now = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()
    assert now == found
