"""What tests share: namespace snapshots, list-file writing, the devices to run on,
training steps, cast counts, Python subprocesses, tiny Hugging Face configs.
The worker scripts beside this file are run by the tests; models.py holds the shared models."""

import ast
import contextlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hmp.binding.aten import dispatched
from hmp.core import torch_releases

NAMESPACES = {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bf16_lstm_missing():
    """Why this torch cannot run nn.LSTM in bfloat16 on this CPU by itself, or None
    (torch 2.4's oneDNN LSTM needs AVX-512 BF16; hmp then runs it as given, with a warning)."""
    try:
        torch.nn.LSTM(2, 2).bfloat16()(torch.ones(1, 1, 2, dtype=torch.bfloat16))
    except RuntimeError as e:
        return f"torch {torch.__version__} itself cannot run a bfloat16 nn.LSTM on this CPU: {str(e)[:80]}"
    return None


NO_BF16_LSTM = _bf16_lstm_missing()


def skip_without_bf16_lstm():
    if NO_BF16_LSTM:
        pytest.skip(NO_BF16_LSTM)


# the running torch's release, (major, minor, patch), for what a library decides by it
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3])


def release_said():
    """hmp's record of warnings already given, holding only what convert() says once per process
    of the running torch's release (torch_releases.release_lacks; tested in a fresh process by
    test_torch_private): for a test that starts its own warnings afresh, on any release."""
    return {("torch lacks", line) for line in torch_releases.release_lacks()}


def release_lines_removed(text):
    """``text`` (a process's stderr) without the release's own warnings and their source lines."""
    lines = text.splitlines()
    drop = {i for i, line in enumerate(lines) for said in torch_releases.release_lacks() if said in line}
    drop |= {i + 1 for i in drop}
    return "\n".join(line for i, line in enumerate(lines) if i not in drop)


def needs(boundary):
    """Skip where the running torch lacks ``boundary`` (a key of hmp's
    torch_releases.BOUNDARIES), with the table's own words: a skip and
    docs/torch-releases.md cannot drift apart."""
    b = torch_releases.BOUNDARIES[boundary]
    return pytest.mark.skipif(
        not b.present,
        reason=f"torch {torch_releases.VERSION} predates {b.first} ({b.what}): {b.without}; docs/torch-releases.md",
    )


def snapshot(namespaces=NAMESPACES):
    """Every entry of the given namespaces ({name: module or class}), by identity."""
    return {name: dict(vars(ns)) for name, ns in namespaces.items()}


def assert_same(before, after):
    for name in before:
        b, a = before[name], after[name]
        assert b.keys() == a.keys(), f"{name}: added {set(a) - set(b)}, removed {set(b) - set(a)}"
        changed = [k for k in b if b[k] is not a[k]]
        assert not changed, f"{name}: entries not identical: {changed[:10]}"


def write(tmp_path, name, text, mode="w"):
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def fp32_list_with(tmp_path, *lines):
    """The shipped FP32 list plus module lines, written as ``tmp_path/fp32.txt``."""
    return write(tmp_path, "fp32.txt", "include default\n" + "\n".join(lines) + "\n")


def casts(fn, weights=()):
    """``(casts, casts of weights, fn's result)``: the casts between floating dtypes ``fn`` dispatches
    (``_to_copy``; ``to`` where inference mode dispatches it whole), and those of the tensors in
    ``weights`` (by identity: autocast casts the parameter itself)."""
    mine = {id(w) for w in weights}
    found = [0, 0]

    def seen(op, args, kwargs):
        name = op.__name__.split(".")[0]
        if name not in ("_to_copy", "to") or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return
        dtype = kwargs.get("dtype", args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
        if dtype is None or dtype == args[0].dtype or not dtype.is_floating_point:
            return
        found[0] += 1
        found[1] += id(args[0]) in mine

    result = dispatched(fn, seen)
    return found[0], found[1], result


def clone_with_backward(backward):
    """An autograd Function whose forward clones its input and whose backward
    calls ``backward(grad)`` (which may raise) and passes the gradient on."""

    class CloneWithBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            backward(grad)
            return grad

    return CloneWithBackward


def training_step(model, opt, loss_fn):
    """``step(x, y)``: one plain training step of ``model`` (``loss_fn(model(x), y)``, backward,
    ``opt.step()``), returning the loss."""

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def classification_problem(make, batch, features, classes=4):
    """``(model, opt, step, x, y)``: a seeded ``make()``, SGD over it (lr 0.1), its cross-entropy
    training_step and a random batch of ``batch`` rows of ``features`` with ``classes`` labels."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(batch, features), torch.randint(0, classes, (batch,))
    return model, opt, training_step(model, opt, F.cross_entropy), x, y


# The start of a script run under TRITON_INTERPRET=1: a plain copy through Triton's interpreter,
# which exits saying INTERPRETER COPIES WRONG where it reads CPU tensors wrong (Triton 3.0 with torch 2.4)
TRITON_INTERPRETER_PROBE = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    probe, out = torch.arange(8.0), torch.zeros(8)
    copy[(1,)](probe, out, 8, BLOCK=64)
    if not torch.equal(probe, out):
        raise SystemExit("INTERPRETER COPIES WRONG: " + str(out.tolist()))
    """
)


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark(script, name=None):
    """A script of benchmarks/ (not a package), imported by its path as module ``name``."""
    spec = importlib.util.spec_from_file_location(name or f"bench_{Path(script).stem}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_python(*args, cwd, env=None, timeout=120):
    """``python *args`` (this interpreter) run to its end in ``cwd``, its output captured as text."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def imported_packages(code):
    """Top-level names of the packages Python source imports (also inside
    try/if blocks), hmp left out: what an example or docs block needs."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - {"hmp", "__future__"}


# -- tiny Hugging Face configs: built, never downloaded (the caller has skipped without transformers) --


def _sizes(vocab, hidden, layers, heads):
    """The size fields BERT's and Llama's configs name alike; the MLP twice as wide as the model."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
    )


def tiny_llama_config(vocab=64, hidden=32, layers=2, **fields):
    """A LlamaConfig: ``layers`` layers of 4 heads sharing 2 key/value heads; ``fields`` set the rest."""
    import transformers

    return transformers.LlamaConfig(**_sizes(vocab, hidden, layers, 4), num_key_value_heads=2, **fields)


def tiny_bert_config(vocab=64, hidden=32, layers=2, heads=4, **fields):
    """A BertConfig of ``layers`` layers of ``heads`` heads; ``fields`` set the rest."""
    import transformers

    return transformers.BertConfig(**_sizes(vocab, hidden, layers, heads), **fields)


def tiny_gpt2_config(vocab=64, hidden=32, layers=2, heads=4, **fields):
    """A GPT2Config of ``layers`` layers of ``heads`` heads; ``fields`` set the rest."""
    import transformers

    return transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, **fields)


def inductor_works():
    try:
        from torch._inductor import cpp_builder  # noqa: F401
    except Exception:
        return False
    import shutil

    return shutil.which("g++") is not None or shutil.which("c++") is not None or shutil.which("gcc") is not None


# torch.compile backends the compile tests run: aot_eager always, inductor where a C++ compiler is
COMPILE_BACKENDS = [
    "aot_eager",
    pytest.param(
        "inductor",
        marks=[
            pytest.mark.slow,
            pytest.mark.torch_internals,
            pytest.mark.skipif(not inductor_works(), reason="inductor needs a C++ compiler"),
        ],
    ),
]


def op_row(op, own, loss, **fields):
    """An audit row built by hand: ``op`` in the BF16 list, ``own`` its own
    (and its output's) max rel error, ``loss`` the error it passes to the
    loss, not timed; ``fields`` change the rest."""
    return {
        "op": op,
        "list": "bf16",
        "calls": 1,
        "casts": 1,
        "max_rel": own,
        "mean_rel": own,
        "nonfinite": 0,
        "own_max_rel": own,
        "loss_error": loss,
        "own_by_module": {},
        "reason": "",
        "flagged": False,
        "fp32_ms": None,
        "lists_ms": None,
        "cast_ms": None,
        **fields,
    }


@contextlib.contextmanager
def profiled(profile):
    """``profile`` as the thread's ``sys.setprofile`` hook for the block; the hook found is back after it."""
    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(old)
