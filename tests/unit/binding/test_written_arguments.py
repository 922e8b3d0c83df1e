"""A written argument is the caller's tensor (docs/never-changes.md): an op
that writes one of its arguments writes the caller's tensor, never a cast
copy, whatever the list and the module's dtype. The arguments an op writes
come from torch's schemas (``Tensor(a!)``), checked here against the
schemas themselves; writes that no schema declares (``F.embedding``'s
``max_norm``, a Python function writing its input) are found after the call.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import write
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding.resolve import Resolver

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = st.sampled_from([BF16, FP16, FP32])
KINDS = st.sampled_from(["bf16", "fp32", "promote"])


def _listed(tmp_path, kind, names):
    """convert() with ``names`` in list ``kind`` (the other lists default)."""
    path = write(tmp_path, f"{kind}.txt", "include default\n" + "\n".join(names) + "\n")
    return hmp.converted(**{f"{kind}_file_path": path})


# -- schemas: every positional tensor argument marked written is known to hmp ---------------------


def _schema_writes():
    """{op name: {(position, argument name)}} for every aten schema that marks
    a positional tensor argument written, read straight from torch."""
    out = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        for i, arg in enumerate(schema.arguments):
            alias = arg.alias_info
            if alias is not None and alias.is_write and not arg.kwarg_only and "Tensor" in str(arg.type):
                out.setdefault(schema.name[6:], set()).add((i, arg.name))
    return out


def test_every_site_knows_the_arguments_its_schema_writes():
    resolver, missing, checked = Resolver(), [], 0
    for op, written in sorted(_schema_writes().items()):
        for site in resolver.sites(op):
            fn = site.original()
            if getattr(fn, "__name__", None) != op:  # a Python function of the same name: found after the call
                continue
            checked += 1
            known = set(site.written) | ({0} if site.inplace else set())
            positions = {i for i, _ in written}
            if not positions <= known | {i for i, _ in site.written}:
                missing.append(f"{site.label}: schema writes {sorted(written)}, hmp knows {sorted(known)}")
    assert checked > 100 and not missing, missing


# -- writes through the rules --------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(kind=KINDS, dtype=DTYPES, momentum=st.sampled_from([0.1, 0.5]), norm=st.sampled_from(["batch", "instance"]))
def test_running_statistics_are_written_into_the_modules_buffers(tmp_path_factory, kind, dtype, momentum, norm):
    tmp_path = tmp_path_factory.mktemp("lists")
    torch.manual_seed(0)
    make = (
        (lambda: nn.BatchNorm1d(4, momentum=momentum))
        if norm == "batch"
        else (lambda: nn.InstanceNorm1d(4, momentum=momentum, track_running_stats=True))
    )
    x = torch.randn(6, 4, 5) * 3 + 2
    plain, mixed = make().to(dtype).train(), make().to(dtype).train()
    for _ in range(3):
        plain(x.to(dtype))
    with _listed(tmp_path, kind, [f"{norm}_norm"]):
        for _ in range(3):
            mixed(x.to(dtype))
    assert mixed.running_mean.dtype == dtype and not torch.equal(
        mixed.running_mean, torch.zeros_like(plain.running_mean)
    )
    # the BF16 rule computes the stats in bf16 (the default BF16 list names both norms and wins over promote)
    computed = BF16 if kind != "fp32" and dtype == FP32 else dtype
    tol = {BF16: 3e-2, FP16: 3e-3, FP32: 1e-3}[computed]
    torch.testing.assert_close(mixed.running_mean.float(), plain.running_mean.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(mixed.running_var.float(), plain.running_var.float(), atol=tol * 4, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(kind=KINDS, dtype=DTYPES, rows=st.lists(st.integers(0, 7), min_size=1, max_size=5))
def test_embedding_max_norm_renormalises_the_weight_itself(tmp_path_factory, kind, dtype, rows):
    tmp_path = tmp_path_factory.mktemp("lists")
    torch.manual_seed(0)
    emb = nn.Embedding(8, 4, max_norm=1.0).to(dtype)
    with torch.no_grad():
        emb.weight.mul_(5)
    before = emb.weight.detach().clone()
    idx = torch.tensor(rows)
    with _listed(tmp_path, kind, ["embedding"]):
        emb(idx)
    after = emb.weight.detach()
    looked_up = sorted(set(rows))
    others = [i for i in range(8) if i not in looked_up]
    assert after.dtype == dtype
    assert (after[looked_up].float().norm(dim=1) <= 1.0 + 1e-2).all()  # renormalised in the module's weight
    assert torch.equal(after[others], before[others])  # the rows not looked up keep their exact values


def test_a_python_function_that_writes_its_input_writes_the_callers_tensor():
    @hmp.fp32_function
    def add_one_in_place(x):
        x.add_(1)
        return x.sum()

    x = torch.zeros(3, dtype=BF16)
    with hmp.converted():
        add_one_in_place(x)
    assert x.dtype == BF16 and x.tolist() == [1.0, 1.0, 1.0]


def test_a_partial_write_rounds_nothing_else():
    @hmp.bf16_function
    def set_first(x):
        x[0] = 7.0

    x = torch.tensor([1.0, 1.0 + 2**-20, 3.14159265])
    expected = x.clone()
    expected[0] = 7.0
    with hmp.converted():
        set_first(x)
    assert torch.equal(x, expected)  # the float32 values the function did not write are exact


@pytest.mark.parametrize("module_dtype", [BF16, FP32])
def test_inside_a_bf16_module_writes_reach_the_modules_tensors(module_dtype):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 3, max_norm=1.0)
            self.bn = nn.BatchNorm1d(3)

        def forward(self, idx):
            return self.bn(self.emb(idx))

    torch.manual_seed(0)
    net = Net().to(module_dtype)
    with torch.no_grad():
        net.emb.weight.mul_(4)
    with hmp.converted(bf16_modules=[Net]):
        net(torch.tensor([0, 1, 2, 3]))
    assert (net.emb.weight[:4].float().norm(dim=1) <= 1.01).all()
    assert net.bn.running_mean.abs().sum() > 0 and net.bn.running_mean.dtype == module_dtype


@pytest.mark.parametrize("kind", ["bf16", "fp32", "promote"])
def test_an_op_whose_schema_writes_an_argument_runs_in_that_arguments_dtype(tmp_path, kind):
    x = torch.randn(5, 3) * 2 + 1
    rm, rv = torch.zeros(3, dtype=BF16), torch.ones(3, dtype=BF16)
    with _listed(tmp_path, kind, ["_native_batch_norm_legit"]):
        out = torch._native_batch_norm_legit(x, None, None, rm, rv, True, 0.5, 1e-5)[0]
    assert rm.dtype == BF16 and rm.abs().sum() > 0  # the caller's running mean, written
    assert out.dtype == BF16  # computed in the written tensor's dtype


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_in_place_and_out_forms_write_the_callers_tensor(tmp_path, kind):
    a = torch.ones(3, dtype=FP32)
    b = torch.ones(3, dtype=BF16)
    out = torch.empty(3, dtype=FP32)
    with _listed(tmp_path, kind, ["add", "relu"]):
        a.add_(b)
        torch.add(b, b, out=out)
        c = torch.full((3,), -1.0, dtype=BF16)
        F.relu(c, inplace=True)
    assert a.dtype == FP32 and a.tolist() == [2.0] * 3
    assert out.dtype == FP32 and out.tolist() == [2.0] * 3
    assert c.dtype == BF16 and c.tolist() == [0.0] * 3
