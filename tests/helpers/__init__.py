"""What tests share: namespace snapshots, list-file writing, the devices to run on.
The worker scripts and models beside this file are run or imported by the tests."""

import ast

import pytest
import torch
import torch.nn.functional as F

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


# the running torch's release, (major, minor, patch), for version-gated skips
# (docs/reliability.md, "torch releases": each says which feature needs which torch)
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3])


def needs_torch(version, why):
    """Skip below ``version`` (a tuple), saying why; never on a torch that has the feature."""
    return pytest.mark.skipif(TORCH < version, reason=f"needs torch >= {'.'.join(map(str, version))}: {why}")


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
