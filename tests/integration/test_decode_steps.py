"""benchmarks/decode.py's compiled decode keeps no output of a compiled call past the next call (issue 67
item 5): CUDA graphs (``mode="reduce-overhead"``) overwrite a graph's outputs at its next replay, and the
decode loop feeds the KV cache back and reads the logits. Each call is marked a step of its own
(``torch.compiler.cudagraph_mark_step_begin()``) and what the loop keeps is a clone. Checked on the CPU with
a tiny Llama: a recorder stands in for the compiled model, logs each call beside each mark, and holds every
call's outputs alive, so a tensor sharing storage with one of them is one of them (no memory is reused)."""

import sys
from pathlib import Path

import pytest
import torch
from helpers import benchmark

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SIZE = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


@pytest.fixture
def decode(monkeypatch):
    """benchmarks/decode.py imported in this process; its sibling modules gone from sys.modules after."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
    before = set(sys.modules)
    yield benchmark("decode.py")
    for name in set(sys.modules) - before:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


@pytest.fixture
def events(monkeypatch):
    """The order of the marks and the model's calls; the real mark still runs (it must do no harm here)."""
    log = []
    real = torch.compiler.cudagraph_mark_step_begin

    def mark():
        log.append("mark")
        real()

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", mark)
    return log


def _tensors(obj):
    """The tensors in a call's inputs or outputs: tensors, lists and dicts of them (a ModelOutput is one), KV caches."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif hasattr(obj, "layers"):  # a transformers Cache: its layers' tensors
        for layer in obj.layers:
            yield from (v for v in vars(layer).values() if isinstance(v, torch.Tensor))


def _storages(obj):
    return {t.untyped_storage().data_ptr() for t in _tensors(obj) if t.untyped_storage().nbytes()}


class Recorder:
    """Stands in for the compiled model: calls it, logs the call, keeps its outputs alive, and notes every
    input that is an earlier call's output."""

    def __init__(self, model, events):
        self.model, self.events = model, events
        self.forward = model.forward  # decode reads the cache argument's name from its signature
        self.held = []  # every call's output tensors, as they were when the call returned
        self.fed_back = []  # (call, input) where an input was an earlier call's output

    def __call__(self, **inputs):
        self.events.append("call")
        mine = _storages(self.held)
        self.fed_back += [(len(self.held), k) for k, v in inputs.items() if _storages(v) & mine]
        out = self.model(**inputs)
        self.held.append(list(_tensors(out)))
        return out

    def outputs(self):
        return {t.untyped_storage().data_ptr() for call in self.held for t in call}


def _tiny(decode):
    models, cfg = decode.build(SIZE, "cpu")
    prompt = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    return models, prompt


def test_a_marked_step_keeps_clones_of_the_calls_outputs(decode, events):
    models, prompt = _tiny(decode)
    model = Recorder(models["fp32"], events)
    with torch.no_grad():
        logits, cache = decode.step(model, True, input_ids=prompt)
        assert events == ["mark", "call"]
        assert len(list(_tensors(cache))) == 2 * SIZE["num_hidden_layers"]  # keys and values, each layer
        assert not _storages([logits, cache]) & model.outputs()
        # the check sees what an unmarked step keeps: the call's own outputs
        logits, cache = decode.step(model, False, input_ids=prompt)
    assert events == ["mark", "call", "call"]
    assert _storages(logits) <= model.outputs() and _storages(cache) <= model.outputs()


def test_every_call_of_a_marked_decode_is_marked_and_fed_no_earlier_output(decode, events):
    models, prompt = _tiny(decode)
    new = 4
    with torch.no_grad():
        plain = decode.generate(models["fp32"], prompt, new)
        model = Recorder(models["fp32"], events)
        assert decode.generate(model, prompt, new, marked=True) == plain  # the clones change no token
        assert events == ["mark", "call"] * new
        assert model.fed_back == []
        # unmarked, each decode call is fed the cache the call before returned
        events.clear()
        model = Recorder(models["fp32"], events)
        decode.generate(model, prompt, new)
    assert events == ["call"] * new
    assert [k for _, k in model.fed_back] == [decode.workloads.cache_kw(models["fp32"])] * (new - 1), model.fed_back


def test_the_compiled_phase_marks_every_call_in_every_configuration(decode, events, monkeypatch):
    """measure_compiled, torch.compile replaced by the recorder (this checks the loop, not the compiler):
    each configuration's calls, warm-up, description and timed rounds alike, come marked, and none is fed
    an earlier call's output; hmp O1 still computes in bfloat16, fp32 in float32."""
    import torch._dynamo

    limits = {
        k: getattr(torch._dynamo.config, k)
        for k in ("cache_size_limit", "recompile_limit")
        if hasattr(torch._dynamo.config, k)
    }
    recorders = {}

    def compile(model, mode=None):
        assert mode is None  # the default mode on a CPU
        return recorders.setdefault(len(recorders), Recorder(model, events))

    monkeypatch.setattr(torch, "compile", compile)
    models, _ = _tiny(decode)
    names, new, rounds = ("fp32", "hmp-O1", "bf16"), 3, 2
    res = decode.measure_compiled(models, SIZE["vocab_size"], "cpu", new, rounds, names)
    assert len(recorders) == len(names)
    calls = events.count("call")
    assert calls >= len(names) * (rounds + 2) * new  # a warm-up, the description and the rounds
    assert events == ["mark", "call"] * calls
    assert all(r.fed_back == [] for r in recorders.values()), [r.fed_back for r in recorders.values()]
    # the recompile limit it raised for the call is back (the next test's dynamo sees its own)
    assert {k: getattr(torch._dynamo.config, k) for k in limits} == limits
    dtypes = {n: c["logits_dtype"] for n, c in res["configs"].items()}
    assert dtypes == {"fp32": "float32", "hmp-O1": "bfloat16", "bf16": "bfloat16"}
