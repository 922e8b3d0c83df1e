"""nms, batched_nms and roi_align in a list bind torchvision.ops, as Habana's HMP did."""

import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import run_python

import hmp
from hmp.binding.resolve import Resolver
from hmp.core.identity import ORIGINAL

ROOT = Path(__file__).resolve().parents[2]
TV_OPS = ("nms", "batched_nms", "roi_align")


def torchvision_ops():
    try:
        import torchvision.ops
    except Exception:  # not installed, or built for another torch
        return None
    return torchvision.ops


def boxes_and_scores(dtype):
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(20, 2, generator=g) * 50
    wh = torch.rand(20, 2, generator=g) * 20 + 1
    return torch.cat([xy, xy + wh], dim=1).to(dtype), torch.rand(20, generator=g).to(dtype)


def test_with_torchvision(tmp_path):
    ops = torchvision_ops()
    if ops is None:
        pytest.skip("torchvision is not importable beside this torch")
    originals = {name: ops.__dict__[name] for name in TV_OPS}
    labels = [s.label for name in TV_OPS for s in Resolver().sites(name)]
    for name in TV_OPS:
        assert f"torchvision.ops.{name}" in labels
    fp32 = tmp_path / "fp32.txt"
    fp32.write_text("\n".join(TV_OPS) + "\nsoftmax\n")
    hmp.convert(fp32_file_path=fp32)
    for name in TV_OPS:
        assert getattr(ops.__dict__[name], ORIGINAL) is originals[name]
    boxes, scores = boxes_and_scores(torch.bfloat16)
    keep = ops.nms(boxes, scores, 0.5)
    expected = originals["nms"](boxes.float(), scores.float(), 0.5)
    assert torch.equal(keep, expected)  # ran on the fp32 copies
    idxs = torch.arange(20) % 3
    assert torch.equal(
        ops.batched_nms(boxes, scores, idxs, 0.5), originals["batched_nms"](boxes.float(), scores.float(), idxs, 0.5)
    )
    feats = torch.randn(1, 4, 16, 16).to(torch.bfloat16)
    rois = torch.tensor([[0, 1.0, 1.0, 9.0, 9.0]], dtype=torch.bfloat16)
    out = ops.roi_align(feats, rois, output_size=(3, 3), spatial_scale=1.0)
    assert out.dtype == torch.float32
    hmp.revert()
    for name in TV_OPS:
        assert ops.__dict__[name] is originals[name]


# A stand-in torchvision (pure torch, records the dtypes it is called with),
# so the binding is tested also where the real one cannot be installed.
STUB_OPS = """\
import torch

calls = []


def nms(boxes, scores, iou_threshold):
    calls.append(("nms", boxes.dtype, scores.dtype))
    return torch.argsort(scores, descending=True)


def batched_nms(boxes, scores, idxs, iou_threshold):
    calls.append(("batched_nms", boxes.dtype, scores.dtype))
    return torch.argsort(scores, descending=True)


def roi_align(input, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False):
    calls.append(("roi_align", input.dtype, boxes.dtype))
    return input[:, :, : output_size[0], : output_size[1]] * 1
"""

STUB_CHECK = """\
import torch, hmp
import torchvision.ops as ops
from hmp.binding.resolve import Resolver

originals = {n: ops.__dict__[n] for n in ("nms", "batched_nms", "roi_align")}
labels = [s.label for n in originals for s in Resolver().sites(n)]
assert labels == ["torchvision.ops.nms", "torchvision.ops.batched_nms", "torchvision.ops.roi_align"], labels

open("bf16.txt", "w").write("roi_align\\nlinear\\n")
open("fp32.txt", "w").write("nms\\nbatched_nms\\n")
hmp.convert(bf16_file_path="bf16.txt", fp32_file_path="fp32.txt")
b = torch.rand(5, 4, dtype=torch.bfloat16)
s = torch.rand(5, dtype=torch.bfloat16)
ops.nms(b, s, 0.5)
ops.batched_nms(b, s, torch.zeros(5, dtype=torch.long), 0.5)
out = ops.roi_align(torch.randn(1, 2, 8, 8), torch.rand(1, 5), (2, 2))
assert out.dtype == torch.bfloat16, out.dtype
hmp.revert()
assert all(ops.__dict__[n] is f for n, f in originals.items())
ops.nms(b, s, 0.5)  # after revert: no cast
print(ops.calls)
"""


def test_stand_in_torchvision_ops_are_bound(tmp_path):
    pkg = tmp_path / "site" / "torchvision"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text(STUB_OPS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    res = run_python("-c", textwrap.dedent(STUB_CHECK), cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    calls = res.stdout.strip().splitlines()[-1]
    assert calls == repr(
        [
            ("nms", torch.float32, torch.float32),
            ("batched_nms", torch.float32, torch.float32),
            ("roi_align", torch.bfloat16, torch.bfloat16),
            ("nms", torch.bfloat16, torch.bfloat16),
        ]
    ), calls
