"""einsum is decided call by call by the kernels each call reaches (hmp/binding/picked.py): over random
equations, contracting and not (1-3 operands of rank 1-3), and random sizes (with opt_einsum installed,
torch picks the contraction order of 3 operands from them), the dtype hmp gives under its transcription
of CPU autocast's lists is the dtype torch.autocast("cpu", torch.bfloat16) gives, and the testing kit's
oracle says the same."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.testing import expected_call

LOW = torch.bfloat16
LETTERS = "ijkl"
SIZES = (2, 3, 5, 17, 64)  # a letter's size (2 or more: no broadcast); far apart, so paths differ


def _lists():
    return dict(
        bf16_file_path=str(hmp.list_path("autocast_cpu_bf16")),
        fp32_file_path=str(hmp.list_path("autocast_cpu_fp32")),
        promote_file_path=str(hmp.list_path("autocast_cpu_promote")),
    )


@st.composite
def equations(draw):
    operands = draw(st.lists(st.text(LETTERS, min_size=1, max_size=3), min_size=1, max_size=3))
    used = sorted(set("".join(operands)))
    kept = draw(st.lists(st.sampled_from(used), unique=True, max_size=len(used)))
    sizes = {c: draw(st.sampled_from(SIZES)) for c in used}
    return ",".join(operands) + "->" + "".join(kept), operands, sizes


@settings(max_examples=60, deadline=None, derandomize=True)
@given(equations())
def test_einsum_runs_in_the_dtype_cpu_autocast_gives(drawn):
    equation, operands, sizes = drawn
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn([sizes[c] for c in o], generator=g) for o in operands]
    with torch.autocast("cpu", LOW):
        expected = torch.einsum(equation, *tensors)
    with hmp.converted(**_lists()):
        got = torch.einsum(equation, *tensors)
        oracle = expected_call(torch.einsum, equation, *tensors)
    assert got.dtype == expected.dtype, equation
    assert (oracle.dtype or torch.float32) == got.dtype, (equation, oracle.rule)
