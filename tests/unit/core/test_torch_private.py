"""Each private torch name hmp reaches resolves and behaves as hmp expects on
the running torch: a new release that breaks one fails here, by name."""

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import clone_with_backward

from hmp.core import torch_private as tp


def test_tensor_base_has_the_cast_methods():
    assert issubclass(torch.Tensor, tp.TensorBase)
    for name in ("half", "bfloat16", "float", "double"):
        assert getattr(tp.TensorBase, name)(torch.ones(2)).dtype == getattr(torch.ones(2), name)().dtype


def test_version_counter_counts_in_place_writes():
    t = torch.zeros(3)
    before = tp.version_of(t)
    t.add_(1)
    assert tp.version_of(t) == before + 1


def test_set_grad_enabled_switches_grad_mode_and_back():
    assert torch.is_grad_enabled()
    tp.set_grad_enabled(False)
    try:
        assert not torch.is_grad_enabled()
    finally:
        tp.set_grad_enabled(True)
    assert torch.is_grad_enabled()


def test_graph_task_id_is_minus_one_outside_backward_and_not_inside():
    get = tp.current_graph_task_id()
    assert get is not None and get() == -1
    seen = []

    Probe = clone_with_backward(lambda grad: seen.append(get()))
    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen and seen[0] != -1


def test_custom_fwd_and_custom_bwd_are_told_from_what_they_decorate():
    def fwd(ctx, x):
        return x

    assert tp.custom_fwd_cast(torch.amp.custom_fwd(fwd, device_type="cpu", cast_inputs=torch.float16)) == torch.float16
    assert tp.custom_fwd_cast(torch.amp.custom_fwd(fwd, device_type="cuda")) is None
    assert tp.custom_fwd_cast(fwd) is False
    assert tp.custom_bwd_inner(torch.amp.custom_bwd(fwd, device_type="cpu")) is fwd
    assert tp.custom_bwd_inner(fwd) is None


def test_function_meta_builds_each_class_its_own_backward_node_class():
    assert "__init__" in tp.FunctionMeta.__dict__
    Clone = clone_with_backward(lambda grad: None)
    assert type(Clone) is tp.FunctionMeta
    node = tp.backward_class(Clone)
    assert issubclass(node, tp.BackwardCFunction) and node is not tp.backward_class(clone_with_backward(print))
    assert type(Clone.apply(torch.ones(2, requires_grad=True)).grad_fn) is node
    # a hook on the metaclass's __init__ sees a new class after torch's __init__ built its node class
    original, made = tp.FunctionMeta.__dict__["__init__"], []

    def __init__(cls, *args):
        original(cls, *args)
        made.append((cls, tp.backward_class(cls)))

    tp.FunctionMeta.__init__ = __init__
    try:
        Later = clone_with_backward(print)
    finally:
        tp.FunctionMeta.__init__ = original
    assert made == [(Later, tp.backward_class(Later))] and made[0][1] is not None


def test_tracing_state_is_set_only_while_tracing():
    assert tp.tracing_state() is None
    seen = []

    def f(x):
        seen.append(tp.tracing_state() is not None)
        return x * 2

    torch.jit.trace(f, torch.ones(2), check_trace=False)
    assert seen == [True]


def test_functorch_transforms_active_only_under_a_transform():
    assert tp.functorch_transforms_active() is False
    seen = []

    def f(x):
        seen.append(tp.functorch_transforms_active())
        return x.sin()

    torch.func.vmap(f)(torch.ones(2, 3))
    assert seen == [True]


def test_vf_serves_the_rnn_kernels():
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell"):
        assert callable(getattr(tp.VF, name))


def test_private_aten_homes_hold_aten_builtins():
    import importlib

    for home in tp.ATEN_PRIVATE_HOMES:
        module = importlib.import_module(home)
        assert any(isinstance(v, type(torch.relu)) for v in vars(module).values()), home
    assert callable(torch._C._nn.cross_entropy_loss)


def test_fused_linear_kernels_exist():
    for name in tp.FUSED_LINEAR_KERNELS:
        assert callable(getattr(torch, name)), name


def test_op_overload_packet_is_what_torch_ops_gives():
    assert isinstance(torch.ops.aten.mm, tp.OpOverloadPacket)


def test_all_schemas_lists_aten_operators():
    names = {s.name for s in tp.all_schemas()}
    assert "aten::mm" in names and "aten::linear" in names


def test_jit_builtin_registration_scripts_a_stand_in_as_the_builtin():
    def stand_in(x):
        raise AssertionError("scripting should compile the builtin, not this")

    name = tp.jit_find_builtin(torch.relu)
    assert name is not None and "relu" in name
    tp.jit_register_builtin(stand_in, name)
    try:
        assert tp.jit_find_builtin(stand_in) == name

        def f(x):
            return stand_in(x)

        assert torch.equal(torch.jit.script(f)(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    finally:
        tp.jit_forget_builtin(id(stand_in))
    assert tp.jit_find_builtin(stand_in) is None


def test_pytree_functions_round_trip():
    tree = {"a": [torch.ones(1), 2], "b": (torch.zeros(1),)}
    leaves, spec = tp.tree_flatten(tree)
    assert tp.tree_unflatten(leaves, spec)["a"][1] == 2
    assert len(tp.tree_leaves(tree)) == 3
    doubled = tp.tree_map_only(torch.Tensor, lambda t: t + 1, tree)
    assert doubled["a"][0].item() == 2 and doubled["a"][1] == 2


def test_autocast_enabled_reads_the_region():
    assert tp.autocast_enabled(torch.autocast("cpu", dtype=torch.bfloat16)) is True
    assert tp.autocast_enabled(torch.autocast("cpu", enabled=False)) is False


def test_engine_run_backward_is_what_backward_calls():
    homes = tp.engine_run_backward_homes()
    assert homes and all(callable(getattr(ns, attr)) for ns, attr in homes)
    namespace, attr = homes[1]
    original, calls = getattr(namespace, attr), []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(namespace, attr, counting)
    try:
        (torch.ones(2, requires_grad=True) * 2).sum().backward()
    finally:
        setattr(namespace, attr, original)
    assert calls == [1]


def test_worker_loop_and_single_process_fetch_exist():
    assert callable(tp.worker_loop())
    assert getattr(tp.WORKER_MODULE, tp.WORKER_LOOP) is tp.worker_loop()
    cls, name = tp.single_process_fetch()
    it = iter(torch.utils.data.DataLoader(list(range(4)), batch_size=2))
    assert isinstance(it, cls) and callable(getattr(it, name))


def test_record_function_exit_call_is_what_a_block_calls_at_its_close():
    overload, name = tp.record_function_exit_call()
    assert overload is torch.ops.profiler._record_function_exit._RecordFunction
    original, calls = vars(overload)[name], []
    assert original is overload.op and hash(overload) == hash(original)

    def counting(record):
        calls.append(record)
        return original(record)

    setattr(overload, name, counting)
    try:
        with pytest.raises(KeyError):  # a block ended by an exception closes through it too
            with torch.autograd.profiler.record_function("block") as block:
                raise KeyError
    finally:
        setattr(overload, name, original)
    assert calls == [block.record]


def test_checkpoint_generator_is_what_non_reentrant_checkpoint_calls():
    name = tp.checkpoint_generator()
    assert name is not None and tp.checkpoint_lacks() == []
    module = tp.CHECKPOINT_MODULE
    original, calls = module.__dict__[name], []

    def counting(fn, *args, **kwargs):
        calls.append(fn)
        return original(fn, *args, **kwargs)

    setattr(module, name, counting)
    try:

        def body(x):
            return x.sin()

        module.checkpoint(body, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
    finally:
        setattr(module, name, original)
    assert calls == [body]


def test_checkpoint_function_forward_gets_the_function():
    function = tp.checkpoint_function()
    assert isinstance(function.__dict__["forward"], staticmethod)


def test_rnn_check_input_and_flat_weights():
    lstm = torch.nn.LSTM(3, 4)
    assert callable(getattr(torch.nn.RNNBase, tp.RNN_CHECK_INPUT))
    weights = tp.rnn_flat_weights(lstm)
    assert len(weights) == 4 and weights[0] is lstm.weight_ih_l0
    with pytest.raises((RuntimeError, ValueError)) as info:
        getattr(lstm, tp.RNN_CHECK_INPUT)(torch.ones(2, 1, 3, dtype=torch.float64), None)
    assert info.traceback[-1].name == tp.RNN_CHECK_INPUT


def test_error_wordings_match_torch_messages():
    with pytest.raises(RuntimeError) as info:
        torch.ones(2, dtype=torch.bfloat16) @ torch.ones(2)
    assert not re.search(tp.NO_KERNEL_MESSAGE, str(info.value))  # a dtype mismatch, not a missing kernel
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g.double())
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert re.search(tp.HOOK_CHANGED_TYPE_MESSAGE, str(info.value)), str(info.value)
    with pytest.raises(RuntimeError) as info:
        F.layer_norm(torch.ones(2, 3, dtype=torch.bfloat16), (3,), torch.ones(3, dtype=torch.float64))
    assert re.search(tp.MIXED_DTYPE_MESSAGE, str(info.value)) or "dtype" in str(info.value)


def test_nothing_is_lacking_on_a_tested_release():
    assert tp.checkpoint_lacks() == [] and tp.step_lacks() == []
    assert tp.VERSION == torch.__version__.split("+")[0]


def test_compiling_answers_as_torch_compiler_is_compiling():
    """The cache's cheaper check says what torch.compiler.is_compiling says:
    eagerly, while dynamo traces, and while export traces."""
    assert tp.compiling() is torch.compiler.is_compiling() is False

    def seen(x):
        return x + (1 if tp.compiling() else 0), torch.compiler.is_compiling()

    out, official = torch.compile(seen, backend="eager", fullgraph=True)(torch.zeros(1))
    assert official and out.item() == 1

    class M(torch.nn.Module):
        def forward(self, x):
            return x + (1 if tp.compiling() else 0) + (10 if torch.compiler.is_compiling() else 0)

    ep = torch.export.export(M(), (torch.zeros(1),), strict=False)
    assert ep.module()(torch.zeros(1)).item() == 11


def test_the_docs_table_is_the_boundaries_table():
    """docs/torch-releases.md shows hmp/core/torch_releases.BOUNDARIES row for row, in order."""
    from pathlib import Path

    from hmp.core import torch_releases

    doc = (Path(__file__).parents[3] / "docs" / "torch-releases.md").read_text()
    shown = [line for line in doc.splitlines() if re.match(r"\| `\w+` \|", line)]
    assert shown == torch_releases.table_rows()


def test_convert_says_once_what_this_release_cannot_keep():
    """On a release without a promise hmp cannot keep, convert() names the release and what is
    not kept, once per process; on the releases that have everything it says nothing of it."""
    import subprocess
    import sys

    from hmp.core import torch_releases

    lines = torch_releases.release_lacks()
    assert all(torch_releases.VERSION in line for line in lines)
    if all(b.present or b.promise_kept for b in torch_releases.BOUNDARIES.values()):
        assert lines == []
    code = "import warnings, hmp; warnings.simplefilter('always'); hmp.convert(); hmp.revert(); hmp.convert()"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for line in lines:
        assert res.stderr.count(line) == 1, res.stderr[-2000:]


def test_the_forward_ad_level_is_nonnegative_only_inside_a_dual_level():
    import torch.autograd.forward_ad as fwAD

    assert tp.forward_ad_level() < 0
    with fwAD.dual_level():
        assert tp.forward_ad_level() >= 0
    assert tp.forward_ad_level() < 0


def test_the_c_apply_of_a_function_runs_its_forward_and_backward():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    t = torch.ones(3, requires_grad=True)
    y = tp.function_apply(Double)(t)
    y.sum().backward()
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(t.grad, torch.full((3,), 2.0))
    assert tp.dispatch_modes() == 0


def test_dispatched_tells_each_op_and_overload_schema_reads_it():
    from hmp.binding.aten import dispatched  # on torch_private's DispatchMode

    seen = []
    out = dispatched(torch.mm, lambda op, a, k: seen.append((op, a)), torch.ones(2, 2), torch.ones(2, 2))
    assert torch.equal(out, torch.full((2, 2), 2.0))
    assert [op for op, _ in seen] == [torch.ops.aten.mm.default] and len(seen[0][1]) == 2
    schema = tp.overload_schema(torch.ops.aten.t.default)
    assert schema.name == "aten::t" and schema.returns[0].alias_info is not None
