"""The Triton kernel of the saturating cast (saturating_cast.py), imported only when a cast first
runs on CUDA: Triton ships with torch's CUDA builds and is never required.

One pass: a float32 value beyond the target's largest finite value becomes that value with its sign
(an infinity stays infinite, NaN stays NaN), then rounds to the target dtype. bf16's rounding is
done on the bits (round to nearest even, NaN to torch's quiet NaN), so the kernel gives torch's
bits on a GPU and in Triton's interpreter alike; fp16's is Triton's conversion, to nearest even.
"""

import triton
import triton.language as tl


@triton.jit
def to_finite_kernel(src, dst, n, top, BLOCK: tl.constexpr, BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(src + offs, mask=inside)
    ax = tl.abs(x)
    x = tl.where((ax > top) & (ax != float("inf")), tl.where(x > 0, top, -top), x)  # NaN fails both tests
    if BF16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        tl.store(dst + offs, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)
    else:
        tl.store(dst + offs, x.to(tl.float16, fp_downcast_rounding="rtne"), mask=inside)
