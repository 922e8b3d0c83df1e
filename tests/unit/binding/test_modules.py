"""Precision by module: module entries in list files and fp32_modules /
bf16_modules, on real models (a tiny Llama from transformers, nn.LSTM),
with the rules checked against an oracle written here."""

import copy
import dataclasses
import io
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_same, fp32_list_with, needs, skip_without_bf16_lstm, snapshot, write
from helpers.models import mlp
from helpers.rmsnorm_entry import IDS, RMSNORM, llama, llama_rmsnorm, record
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp

BF16, FP32 = torch.bfloat16, torch.float32
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# -- a tiny Llama with LlamaRMSNorm in the FP32 list ------------------------------------------
# (its effect on a training run's loss: tests/integration/test_rmsnorm_entry_training.py)


def test_rmsnorm_in_the_fp32_list_computes_fp32_rmsnorm_bit_for_bit(tmp_path):
    model = llama()
    seen, hooks = record(model, llama_rmsnorm())
    gate = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda mod, args, out: gate.append(out.dtype))
    with hmp.converted(fp32_file_path=fp32_list_with(tmp_path, RMSNORM)):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
    for h in hooks:
        h.remove()
    assert len(seen) == 5  # two per layer and the final norm
    for module, x, out in seen:
        assert out.dtype == FP32
        with torch.no_grad():
            assert torch.equal(out, module(x.float()))  # plain fp32 RMSNorm of the same input
    assert gate == [BF16]  # everything else as under O1
    assert {p.grad.dtype for p in model.parameters()} == {FP32}
    assert {p.dtype for p in model.parameters()} == {FP32}


def test_the_same_from_python_by_class_and_by_name(tmp_path):
    model = llama()
    seen, _ = record(model, llama_rmsnorm())
    # strict=True: Habana's rule runs RMSNorm's multiplies in bf16, so an entry shows
    with hmp.converted(fp32_modules=["*.post_attention_layernorm"], model=model, strict=True):
        model(input_ids=IDS)
    assert [out.dtype for _, _, out in seen] == [BF16, FP32, BF16, FP32, BF16]
    seen.clear()
    with hmp.converted(fp32_modules=[llama_rmsnorm(), model.lm_head], strict=True):
        logits = model(input_ids=IDS).logits
    assert {out.dtype for _, _, out in seen} == {FP32} and logits.dtype == FP32


# -- nn.LSTM ---------------------------------------------------------------------------------------


def test_lstm_in_the_bf16_list_runs_as_a_bf16_lstm(tmp_path):
    skip_without_bf16_lstm()
    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 16, 2), torch.randn(5, 3, 8)
    as_bf16 = copy.deepcopy(lstm).bfloat16()
    with hmp.converted(bf16_file_path=write(tmp_path, "bf16.txt", "torch.nn.LSTM\n")):
        assert hmp.effective_lists()["bf16"] == ["torch.nn.modules.rnn.LSTM"]  # no op listed: the module entry alone
        out, (h, c) = lstm(x)
        out.float().sum().backward()
    assert out.dtype == h.dtype == BF16
    assert torch.equal(out, as_bf16(x.bfloat16())[0])  # as if converted with .to(bfloat16) for the call
    assert {p.dtype for p in lstm.parameters()} == {p.grad.dtype for p in lstm.parameters()} == {FP32}


def test_lstm_in_the_fp32_list_fed_bf16_runs_in_fp32(tmp_path):
    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 16), torch.randn(5, 3, 8).bfloat16()
    with hmp.converted(fp32_file_path=fp32_list_with(tmp_path, "torch.nn.LSTM")):  # lstm itself is BF16-listed
        out, _ = lstm(x)
    assert out.dtype == FP32
    # the reference with grad on too: CPU LSTMs pick another kernel under no_grad
    assert torch.equal(out, lstm(x.float())[0])


# -- malformed module lines ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "no_such_package.Norm",
            r"line 2: 'no_such_package.Norm' is no op and no importable path: no module named "
            r"'no_such_package'",
        ),
        (
            "torch.nn.functional.layer_norm",
            r"line 2: unknown op 'torch.nn.functional.layer_norm'; did you mean "
            r"layer_norm\?.*is a function",
        ),
        ("collections.OrderedDict", r"line 2: 'collections.OrderedDict' is a class but not a torch.nn.Module subclass"),
        ("torch.nn.NoSuchNorm", r"line 2: 'torch.nn.NoSuchNorm': 'torch.nn' has no attribute 'NoSuchNorm'"),
        (
            "torch.nn.modules.linear.math.pi",
            r"line 2: 'torch.nn.modules.linear.math.pi' is a float, not a "
            r"torch.nn.Module subclass",
        ),
    ],
)
def test_malformed_module_lines_name_file_and_line_and_patch_nothing(tmp_path, pristine, line, message):
    before = dict(vars(nn.LSTM))
    hmp.convert()  # a conversion in force stays as it was
    path = write(tmp_path, "bf16.txt", f"linear\n{line}\n")
    with pytest.raises(ValueError, match=rf"bf16\.txt'(.|\n)*{message}"):
        hmp.convert(bf16_file_path=path)
    assert "linear" in hmp.effective_lists()["bf16"] and len(hmp.effective_lists()["bf16"]) > 1
    hmp.revert()
    assert_same(pristine, snapshot())
    assert vars(nn.LSTM) == before


def test_module_entries_are_checked_like_op_names(tmp_path, pristine):
    with pytest.raises(
        ValueError,
        match=r"promote\.txt'(.|\n)*line 1: 'torch.nn.LSTM': module entries go in the "
        r"BF16 or FP32 list",
    ):
        hmp.convert(promote_file_path=write(tmp_path, "promote.txt", "torch.nn.LSTM\n"))
    with pytest.raises(ValueError, match=r"module classes in both .*torch.nn.modules.rnn.LSTM"):
        hmp.convert(
            bf16_file_path=write(tmp_path, "b.txt", "torch.nn.LSTM\n"),
            fp32_file_path=write(tmp_path, "f.txt", "torch.nn.LSTM\n"),
        )
    with pytest.raises(ValueError, match=r"fp32_modules\[0\]: 'lm_hed' matches no module of the model"):
        hmp.convert(fp32_modules=["lm_hed"], model=nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(
        ValueError,
        match=r"fp32_modules\[0\]: 'lm_head' is a module name pattern, and convert\(\) "
        r"got no model=",
    ):
        hmp.convert(fp32_modules=["lm_head"])
    with pytest.raises(TypeError, match=r"bf16_modules\[1\]: expected a module class"):
        hmp.convert(bf16_modules=[nn.LSTM, 3])
    with pytest.raises(ValueError, match=r"both the BF16 and the FP32 rule"):
        hmp.convert(bf16_modules=[nn.LSTM], fp32_modules=["torch.nn.LSTM"])
    assert_same(pristine, snapshot())


# -- the rules, against an oracle ------------------------------------------------------------------


class Leaf(nn.Module):
    """A listed op (linear, BF16 list) and an unlisted one (tanh), dtypes recorded."""

    def __init__(self, log):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.log = log

    def forward(self, x):
        y = F.linear(x, self.weight)
        z = torch.tanh(x)
        self.log.append((y.dtype, z.dtype))
        return y + z.to(y.dtype)


class Level(nn.Module):
    def __init__(self, child, disable=False):
        super().__init__()
        self.child, self.disable = child, disable

    def forward(self, x):
        if self.disable:
            with hmp.disable_casts():
                return self.child(x)
        return self.child(x)


LEVELS = st.lists(st.sampled_from(["none", "fp32", "bf16", "disable"]), max_size=5)


def oracle(levels, x_dtype):
    """(linear's dtype, tanh's dtype, output dtype), from the documented
    rules, outermost level first."""
    off, rule, x = False, None, x_dtype
    exits = []  # what each active module does to the output on the way out
    for level in levels:
        if level == "disable":
            off = True
        elif level in ("fp32", "bf16") and not off:
            rule = level
            x = FP32 if level == "fp32" and x == BF16 else BF16 if level == "bf16" and x == FP32 else x
            exits.append(level)
    if off or rule == "fp32":
        linear, tanh = x, x  # casts off: both compute in their inputs' dtype (the weight is fp32)
        if x == BF16:
            linear = None  # bf16 input with an fp32 weight: torch refuses
    elif rule == "bf16":
        linear, tanh = BF16, BF16  # the mode lowers the unlisted op too
    else:
        linear, tanh = BF16, x  # O1: linear listed, tanh untouched
    out = None if linear is None else linear
    for level in reversed(exits):
        if out is not None and level == "fp32":
            out = FP32
    return linear, tanh, out


@settings(deadline=None)
@given(levels=LEVELS, x_dtype=st.sampled_from([FP32, BF16]), by_class=st.booleans())
def test_nested_module_rules_follow_the_oracle(levels, x_dtype, by_class):
    torch.manual_seed(0)
    log = []
    model = Leaf(log)
    kinds = {"fp32": [], "bf16": []}
    for level in reversed(levels):
        model = Level(model, disable=level == "disable")
        if level in kinds:
            kinds[level].append(model)
    if by_class:  # each policy module its own class, listed by class
        for kind, mods in kinds.items():
            for m in mods:
                m.__class__ = type(f"{kind}Level{id(m)}", (Level,), {})
        kinds = {k: [type(m) for m in mods] for k, mods in kinds.items()}
    expected = oracle(levels, x_dtype)
    with hmp.converted(fp32_modules=kinds["fp32"], bf16_modules=kinds["bf16"]):
        x = torch.randn(2, 4, dtype=x_dtype)
        if expected[0] is None:
            with pytest.raises(RuntimeError):
                model(x)
        else:
            out = model(x)
            assert (log[-1][0], log[-1][1], out.dtype) == expected
        assert hmp.casts_enabled()  # every path out left the thread's state as it found it


def test_the_oracle_is_not_the_implementation():
    """A few rows worked by hand."""
    assert oracle([], FP32) == (BF16, FP32, BF16)
    assert oracle(["fp32"], BF16) == (FP32, FP32, FP32)
    assert oracle(["fp32", "bf16"], FP32) == (BF16, BF16, FP32)
    assert oracle(["bf16", "fp32"], FP32) == (FP32, FP32, FP32)
    assert oracle(["disable", "fp32"], BF16) == (None, BF16, None)


def test_a_module_policy_is_per_thread():
    inside, release = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def forward(self, x):
            inside.set()
            release.wait(10)
            return F.linear(x, torch.ones(2, 2))

    other = []

    def run_other():
        inside.wait(10)
        other.append(F.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype)
        release.set()

    with hmp.converted(fp32_modules=[Slow]):
        t = threading.Thread(target=run_other)
        t.start()
        assert Slow()(torch.ones(2, 2)).dtype == FP32
        t.join(10)
    assert other == [BF16]


def test_an_exception_in_a_policy_module_leaves_the_state_as_it_was():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    with hmp.converted(fp32_modules=[Boom], bf16_modules=[nn.Linear]):
        for module in (Boom(), nn.Sequential(nn.Linear(2, 2), Boom())):
            with pytest.raises(KeyError):
                module(torch.ones(2, 2))
            assert hmp.casts_enabled() and F.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == BF16
            assert not torch._C._is_torch_function_mode_enabled()


# -- exact undo, and only modules with a policy are touched --------------------------------------


class Norm(nn.LayerNorm):
    pass


class OwnNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 1


def test_revert_restores_classes_and_instances_exactly(pristine):
    classes = (nn.LayerNorm, Norm, OwnNorm, nn.Linear, nn.Module)
    before = {c: dict(vars(c)) for c in classes}
    lin = nn.Linear(2, 2)
    lin_dict = dict(vars(lin))
    with hmp.converted(fp32_modules=[nn.LayerNorm], bf16_modules=[lin]):
        # a class entry wraps __call__ (forward stays the class's own), on the class and on a subclass
        # that defines its own; a subclass without one inherits it
        assert vars(nn.LayerNorm)["__call__"].__hmp_original__ is nn.Module.__call__
        assert vars(nn.LayerNorm)["forward"] is before[nn.LayerNorm]["forward"]
        assert "__call__" not in vars(OwnNorm) and "__call__" not in vars(Norm)
        # forward and __init__ are untouched without an entry (no shipped uncast entry names construction)
        for c in (nn.Linear, nn.Module):
            assert vars(c)["forward"] is before[c]["forward"] and vars(c)["__init__"] is before[c]["__init__"]
        assert "forward" in vars(lin)
        assert OwnNorm(4)(torch.randn(2, 4).bfloat16()).dtype == FP32
    for c in classes:
        assert vars(c) == before[c], c
    assert vars(lin) == lin_dict
    assert_same(pristine, snapshot())


def test_converting_again_never_wraps_a_module_entry():
    lin = nn.Linear(2, 2)
    before = dict(vars(nn.LayerNorm))
    for _ in range(2):
        hmp.convert(fp32_modules=[lin, nn.LayerNorm])
        assert lin(torch.randn(1, 2).bfloat16()).dtype == FP32
        assert vars(nn.LayerNorm)["__call__"].__hmp_original__ is nn.Module.__call__
        assert vars(nn.LayerNorm)["forward"] is before["forward"]
        assert lin.forward.__func__.__hmp_original__ is vars(nn.Linear)["forward"]
    hmp.revert()
    assert "forward" not in vars(lin) and vars(nn.LayerNorm) == before


def test_a_subclass_listed_itself_keeps_its_own_rule():
    with hmp.converted(fp32_modules=[nn.LayerNorm], bf16_modules=[OwnNorm]):
        assert nn.LayerNorm(4)(torch.randn(2, 4).bfloat16()).dtype == FP32
        assert OwnNorm(4)(torch.randn(2, 4)).dtype == BF16


def test_a_copy_made_while_converted_is_a_plain_module_of_its_class():
    """An instance entry names one object: a deep copy or a saved model made
    while converted runs as any other module of its class (LayerNorm's op is
    BF16-listed), with its own weights, and holds nothing of hmp."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4)
    with hmp.converted(fp32_modules=[model[1]]):
        twin = copy.deepcopy(model)
        shallow = copy.copy(model[1])
        with torch.no_grad():
            twin[1].weight.fill_(2.0)
        entry, copied = model(x), twin(x)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        assert "forward" not in vars(twin[1]) and "forward" not in vars(shallow)
    assert entry.dtype == FP32 and copied.dtype == BF16
    assert torch.allclose(copied.float(), 2 * model(x), atol=0.1)  # the copy runs its own weights
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert not {"forward", "__getstate__"} & (set(vars(loaded[1])) | set(vars(model[1])) | set(vars(twin[1])))
    assert loaded(x).dtype == FP32 and torch.equal(loaded(x), model(x))
    hmp.convert()  # a later conversion without entries: the copy follows the lists like its class
    try:
        assert twin(x).dtype == BF16 and loaded(x).dtype == BF16
    finally:
        hmp.revert()


# -- training stacks ------------------------------------------------------------------------------------


class Block(nn.Module):
    """A block whose forward checkpoints an inner part."""

    def __init__(self, reentrant):
        super().__init__()
        self.lin, self.norm, self.reentrant = nn.Linear(8, 8), nn.LayerNorm(8), reentrant
        self.gate = nn.Parameter(torch.randn(8))

    def inner(self, x):
        # sigmoid is in no list: in a BF16 module only the module's mode lowers it
        return torch.tanh(self.norm(self.lin(x))) * torch.sigmoid(self.gate)

    def forward(self, x, checkpointed):
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.inner(x)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_gradient_checkpointing_recomputes_under_the_module_policy(kind, reentrant):
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        block = Block(reentrant)
        x = torch.randn(4, 8, requires_grad=True)
        with hmp.converted(**{f"{kind}_modules": [Block]}):
            out = block(x, checkpointed)
            assert out.dtype == (FP32 if kind == "fp32" else BF16)
            out.float().sum().backward()
        grads.append([p.grad for p in block.parameters()] + [x.grad])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_with_rmsnorm_in_fp32(reentrant):
    """The recompute runs RMSNorm in fp32 as the forward did (non-reentrant
    checkpointing also checks every recomputed tensor's dtype). Gradients
    match the uncheckpointed run up to the order bf16 gradients are summed
    in, which checkpointing changes under O1 with or without the entry."""
    grads = []
    for checkpointing in (False, True):
        model = llama()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        seen, _ = record(model, llama_rmsnorm())
        with hmp.converted(fp32_modules=[llama_rmsnorm()]):
            model(input_ids=IDS, labels=IDS).loss.backward()
        assert len(seen) == (9 if checkpointing else 5) and {out.dtype for _, _, out in seen} == {FP32}
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0.05, atol=1e-3)


@pytest.mark.slow
@pytest.mark.torch_internals
@needs("traced_state_writes")
def test_compile_adds_no_graph_break_for_modules_without_a_policy(fresh_dynamo):
    model = mlp(8, 8, 8)
    x = torch.randn(4, 8)

    def breaks(**kwargs):
        torch._dynamo.reset()
        with hmp.converted(**kwargs):
            return torch._dynamo.explain(model)(x).graph_break_count

    assert breaks(fp32_modules=[nn.LSTM]) == breaks()
    with hmp.converted(fp32_modules=[nn.LayerNorm]):
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager")(x)
    assert compiled.dtype == eager.dtype == BF16
    assert torch.equal(compiled, eager)


def test_a_forward_another_library_wraps_on_an_instance_entry_survives_revert():
    """accelerate's hooks (cpu_offload, dispatch_model) set ``module.forward``
    to their wrapper of what is there: revert() leaves theirs, and hmp's entry
    they hold (and put back when they remove their hook) runs the original."""
    m, x = nn.Linear(4, 2), torch.randn(3, 4)
    calls = []
    with hmp.converted(bf16_modules=[m]):
        held = m.forward

        def hooked(*args, **kwargs):
            calls.append(1)
            return held(*args, **kwargs)

        m.forward = hooked
        assert m(x).dtype == BF16
    assert m.forward is hooked
    assert m(x).dtype == FP32 and len(calls) == 2
    m.forward = held  # the library removes its hook
    assert m(x).dtype == FP32 and torch.equal(m(x), F.linear(x, m.weight, m.bias))


class _CosSin(nn.Module):
    def forward(self, x):
        return x.cos(), x.sin()


class _Nested(nn.Module):
    def forward(self, x):
        return {"a": [x, x * 2], "b": None}


def test_an_fp32_module_returning_tensors_maps_them_without_pytree():
    """A module entry's outputs go to float32 at any nesting; a tensor or a plain tuple of tensors
    (a rotary embedding's cos and sin) without pytree's map, which costs each call some twenty frames."""
    from helpers import profiled

    x = torch.randn(4).bfloat16()
    called = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    with hmp.converted(fp32_modules=[_CosSin, _Nested]):
        module = _CosSin()
        module(x)
        with profiled(profile):
            out = module(x)
        nested = _Nested()(x)  # anything else still goes through pytree: a dict of a list and None
    assert type(out) is tuple and [t.dtype for t in out] == [torch.float32] * 2
    assert torch.equal(out[0], x.float().cos()) and torch.equal(out[1], x.float().sin())
    assert "tree_map_only" not in called and "tree_map" not in called, called
    assert [t.dtype for t in nested["a"]] == [torch.float32] * 2 and nested["b"] is None


class _Pair(tuple):
    """A tuple subclass, as some libraries return."""


class _Items(list):
    """A list subclass with an attribute of its own."""


class _Table(dict):
    """A dict subclass pytree does not know."""


@dataclasses.dataclass
class _Out:
    a: torch.Tensor
    rest: object = None


@dataclasses.dataclass(frozen=True)
class _Frozen:
    a: torch.Tensor


def _containers(y):
    items = _Items([y, 1])
    items.tag = "kept"
    return {
        "tuple subclass": _Pair((y, y)),
        "list subclass": items,
        "dict subclass": _Table(a=y, b="text"),
        "dataclass": _Out(y, rest=[y, _Pair((y,))]),
        "frozen dataclass": _Frozen(y),
        "dataclass in a dict": {"out": _Out(y)},
    }


def _tensors(o):
    """Every tensor in ``o``, walked by hand (the oracle: no pytree, no hmp)."""
    if isinstance(o, torch.Tensor):
        return [o]
    if dataclasses.is_dataclass(o):
        o = [getattr(o, f.name) for f in dataclasses.fields(o)]
    if isinstance(o, dict):
        o = list(o.values())
    if isinstance(o, (list, tuple)):
        return [t for v in o for t in _tensors(v)]
    return []


class _Emits(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return _containers(x.bfloat16() * 1.0)[self.kind]


@pytest.mark.parametrize("kind", list(_containers(torch.zeros(1))), ids=list(_containers(torch.zeros(1))))
def test_an_fp32_module_maps_tensors_in_any_container_and_keeps_its_type(kind):
    """The FP32 list's rule, outputs in float32, reaches tensors inside containers pytree takes for
    leaves (tuple, list and dict subclasses, dataclasses, frozen ones too), each keeping its type and
    what else it holds."""
    x = torch.randn(3)
    with hmp.converted(fp32_modules=[_Emits]):
        out = _Emits(kind)(x)
    want = _containers(x.bfloat16() * 1.0)[kind]
    assert type(out) is type(want)
    got, expected = _tensors(out), _tensors(want)
    assert len(got) == len(expected) > 0
    assert all(g.dtype == torch.float32 and torch.equal(g, e.float()) for g, e in zip(got, expected))
    if kind == "list subclass":
        assert out.tag == "kept" and out[1] == 1
    if kind == "dict subclass":
        assert out["b"] == "text"


def test_an_fp32_module_returning_a_model_output_keeps_its_type_and_both_views():
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Encoder(nn.Module):
        def forward(self, x):
            y = x.bfloat16() * 1.0
            return outputs.BaseModelOutput(last_hidden_state=y, hidden_states=(y, y))

    x = torch.randn(2, 3)
    with hmp.converted(fp32_modules=[Encoder]):
        out = Encoder()(x)
    assert type(out) is outputs.BaseModelOutput
    assert out.last_hidden_state.dtype == out["last_hidden_state"].dtype == torch.float32
    assert [t.dtype for t in out.hidden_states] == [torch.float32] * 2
    assert out[0] is out.last_hidden_state
