"""What hmp reports is what it does (issue 45): an audit of lists that name
entries hmp does not cast says which and why, in its table and its page,
from the same decision convert() binds by (hmp/binding/pays.py)."""

import torch
import torch.nn.functional as F
from helpers.models import mlp

import hmp
from hmp.tools.report.page import render


def _step_and_state():
    model = mlp(8, 16, 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return step, (x, y), (model, opt)


def test_the_audit_names_each_entry_it_does_not_cast_and_why(tmp_path):
    path = tmp_path / "bf16.txt"
    path.write_text("include default\nrelu\nlayer_norm\n")
    step, args, state = _step_and_state()
    hmp.convert(bf16_file_path=path)
    report = hmp.audit(step, *args, state=state)
    by_entry = {entry: why for why, entries in report.uncast.items() for entry in entries}
    assert "pointwise" in by_entry["bf16 relu"] and "normalisation" in by_entry["bf16 layer_norm"]
    assert "bf16 linear" not in by_entry and "fp32 cross_entropy" not in by_entry  # those cast
    assert by_entry == {
        f"{kind} {name}": why
        for kind, entries in hmp.effective_lists(detail=True).items()
        for name, why in entries.items()
        if why != "cast" and not why.startswith("module entry")
    }
    assert "bf16 relu" in report.table() and "List entries not cast" in render(audit=report)
    assert {r["op"] for r in report.rows} >= {"linear", "cross_entropy"}
    rows = {r["op"]: r for r in report.rows}
    assert "relu" not in rows  # never wrapped, so never recorded
    # layer_norm, given linear's bf16 output with float32 weight, is in no list's rule: it runs as torch
    # runs it (wrapped only to promote a mix its kernel rejects), and casts nothing
    assert "layer_norm" not in rows or rows["layer_norm"]["casts"] == 0
    hmp.convert(bf16_file_path=path, strict=True)  # Habana's rule: both cast, and the audit sees them
    report = hmp.audit(step, *args, state=state)
    assert not any("bf16 relu" in entries for entries in report.uncast.values())
    assert {"relu", "layer_norm"} <= {r["op"] for r in report.rows}  # wrapped: each call recorded
