"""torch.fx.symbolic_trace and torch.export.export on a model while hmp is converted.

What docs/integrations.md#fx-tracing-and-torchexport says, checked:
- an FX GraphModule's generated code calls torch's functions by name, so
  calling it casts exactly as the model would at that time, whenever and under
  whichever conversion it was traced;
- torch.export records aten ops, so a program exported while converted keeps
  hmp's casts after revert(), and one exported after revert() has none.
"""

import pytest
import torch
from helpers.models import ProductSpellings

import hmp

pytestmark = pytest.mark.skipif(not hasattr(torch, "export"), reason="no torch.export")


def dtypes(outputs):
    return [t.dtype for t in outputs]


@pytest.fixture
def net_and_input():
    torch.manual_seed(0)
    return ProductSpellings(), torch.randn(8, 8)


def test_fx_graph_code_calls_torch_by_name_so_a_later_conversion_applies(net_and_input):
    net, x = net_and_input
    hmp.convert(opt_level="O1")
    graph = torch.fx.symbolic_trace(net)
    hmp.revert()
    for call in ("torch.mm(", "torch.nn.functional.relu(", "torch.nn.functional.softmax("):
        assert call in graph.code, graph.code
    hmp.convert(opt_level="O2")
    eager, traced = net(x), graph(x)
    hmp.revert()
    assert dtypes(traced) == dtypes(eager)
    for a, b in zip(traced, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("traced_while_converted", [True, False])
def test_fx_graph_casts_exactly_when_run_while_converted(net_and_input, traced_while_converted):
    net, x = net_and_input
    plain = net(x)
    if traced_while_converted:
        hmp.convert()
        graph = torch.fx.symbolic_trace(net)
    else:
        graph = torch.fx.symbolic_trace(net)
        hmp.convert()
    eager, traced = net(x), graph(x)
    assert dtypes(traced) == dtypes(eager) == [torch.bfloat16, torch.float32]
    for a, b in zip(traced, eager):
        assert torch.equal(a, b)
    hmp.revert()
    after = graph(x)
    assert dtypes(after) == [torch.float32, torch.float32]
    for a, b in zip(after, plain):
        assert torch.equal(a, b)


def test_export_while_converted_keeps_the_casts_after_revert(net_and_input):
    net, x = net_and_input
    hmp.convert()
    eager = net(x)
    program = torch.export.export(net, (x,), strict=False)
    hmp.revert()
    to_bf16 = [  # torch 2.4 records the dtype as a keyword
        n for n in program.graph.nodes if n.op == "call_function" and torch.bfloat16 in (*n.args, n.kwargs.get("dtype"))
    ]
    assert to_bf16, "the exported graph has no cast to bfloat16"
    exported = program.module()(x)
    assert dtypes(exported) == [torch.bfloat16, torch.float32]
    for a, b in zip(exported, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_export_after_revert_has_no_casts(net_and_input):
    net, x = net_and_input
    plain = net(x)
    hmp.convert()
    net(x)
    hmp.revert()
    program = torch.export.export(net, (x,), strict=False)
    assert not [n for n in program.graph.nodes if n.op == "call_function" and torch.bfloat16 in n.args]
    hmp.convert()  # an exported program calls aten ops hmp does not patch
    exported = program.module()(x)
    hmp.revert()
    assert dtypes(exported) == [torch.float32, torch.float32]
    for a, b in zip(exported, plain):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
