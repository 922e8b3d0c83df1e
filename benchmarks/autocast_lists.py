"""Write hmp list files holding the ops torch.autocast casts, per device.

    python benchmarks/autocast_lists.py           # (re)write op_lists/autocast_*.txt
    python benchmarks/autocast_lists.py --check   # fail if the files are stale

Sources, for the installed torch:

* CPU: the ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` block of
  ``aten/src/ATen/autocast_mode.cpp`` (transcribed below as op names and
  policies; the .cpp is not shipped in wheels). The transcription is checked
  against the live dispatcher: the set of ops with an ``AutocastCPU`` kernel
  in the installed torch must equal it exactly.
* CUDA: the ``AT_FORALL_*`` macros of the installed
  ``torch/include/ATen/autocast_mode.h`` (parsed), plus the two cuDNN ops
  that autocast_mode.cpp registers beside them; checked against the
  dispatcher's ``AutocastCUDA`` kernels (registered even in CPU builds).

Only names hmp can bind (a Python entry point that reaches the op: torch.X,
torch.nn.functional.X, torch.Tensor.X, torch.linalg/fft/_C._nn builtins)
go into the files; each name is validated by hmp.convert itself, which
raises ValueError on an unknown op and warns on one it cannot bind. Dropped names are listed in each file's
header.
"""

import argparse
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hmp  # noqa: E402

LIST_DIR = ROOT / "op_lists"

# TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) in autocast_mode.cpp (torch 2.13),
# overloads folded into their op name.
CPU_LOWER = """
conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm
linear _convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
_native_multi_head_attention
""".split()
CPU_FP32 = """
avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft
cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace
view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr
ormqr pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d
reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss
huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
multi_margin_loss ctc_loss kl_div multilabel_margin_loss
binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn
fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft
fft_ihfft linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky
linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
linalg_householder_product linalg_tensorinv linalg_tensorsolve
fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
linalg_eigh linalg_lstsq linalg_inv_ex
""".split()
CPU_PROMOTE = "stack cat index_copy".split()

# registered next to the AT_FORALL_* macros in the AutocastCUDA block
CUDA_EXTRA_LOWER = ["cudnn_convolution", "cudnn_convolution_transpose"]
CUDA_BANNED = ["binary_cross_entropy"]  # autocast raises for it: no policy

# aten op reached from Python only through a differently named entry point
ENTRY_POINT = {"cross_entropy_loss": "cross_entropy"}

FILES = {
    "cpu": {"bf16": "autocast_cpu_bf16.txt", "fp32": "autocast_cpu_fp32.txt", "promote": "autocast_cpu_promote.txt"},
    "cuda": {
        "bf16": "autocast_cuda_lower.txt",
        "fp32": "autocast_cuda_fp32.txt",
        "promote": "autocast_cuda_promote.txt",
    },
}


def list_paths(device):
    """{"bf16", "fp32", "promote"} -> path of the autocast list files for ``device``."""
    return {k: LIST_DIR / v for k, v in FILES[device].items()}


def _header_path():
    return Path(torch.__file__).resolve().parent / "include" / "ATen" / "autocast_mode.h"


def _macro_names(text, macro):
    m = re.search(r"#define " + macro + r"\(_\)(.*?)(?:\n\s*\n|\n#)", text, re.S)
    if not m:
        raise RuntimeError(f"macro {macro} not found in autocast_mode.h")
    body = m.group(1)
    names = re.findall(r"_\(\s*(?:ADD_NS\()?([A-Za-z_0-9]+)", body)
    return list(dict.fromkeys(names))


def cuda_policies():
    text = _header_path().read_text()
    lower = _macro_names(text, "AT_FORALL_LOWER_PRECISION_FP") + CUDA_EXTRA_LOWER
    fp32 = (
        _macro_names(text, "AT_FORALL_FP32")
        + _macro_names(text, "AT_FORALL_FP32_SET_OPT_DTYPE")
        + _macro_names(text, "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE")
    )
    promote = _macro_names(text, "AT_FORALL_PROMOTE")
    return {"bf16": lower, "fp32": fp32, "promote": promote}


def cpu_policies():
    return {"bf16": list(CPU_LOWER), "fp32": list(CPU_FP32), "promote": list(CPU_PROMOTE)}


def dispatcher_ops(key):
    """Base names of the aten ops with a kernel for dispatch key ``key``."""
    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            out.add(name[len("aten::") :].split(".")[0])
    return out


def check_against_dispatcher(policies, key, extra=()):
    listed = set().union(*map(set, policies.values())) | set(extra)
    live = dispatcher_ops(key)
    if listed != live:
        raise SystemExit(
            f"{key}: transcription differs from the installed torch {torch.__version__}:\n"
            f"  only in transcription: {sorted(listed - live)}\n  only in dispatcher: {sorted(live - listed)}"
        )


def hmp_knows(name, _cache=None):
    """True when hmp.convert accepts ``name`` in a list file and binds it
    somewhere (public API only): a real aten op with nothing to bind in
    Python, or a name that is no precision choice (a view), is skipped with a
    warning, and left out here."""
    if _cache is None:
        _cache = {}
    if name not in _cache:
        fd, path = tempfile.mkstemp(suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(name + "\n")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with hmp.converted(bf16_file_path=path):
                    pass
            said = [str(w.message) for w in caught]  # skipped: no Python entry point, or no precision choice
            _cache[name] = not any("nothing to bind" in m or "not a precision choice" in m for m in said)
        except ValueError:
            _cache[name] = False
        finally:
            os.unlink(path)
    return _cache[name]


def render(device, kind, names, source):
    kept, dropped, mapped = [], [], []
    for n in names:
        target = ENTRY_POINT.get(n, n)
        if hmp_knows(target):
            if target != n:
                mapped.append(f"{n} -> {target}")
            if target not in kept:
                kept.append(target)
        else:
            dropped.append(n)
    what = {
        "bf16": "cast to the lower precision dtype (lower_precision_fp policy)",
        "fp32": "cast to float32 (fp32 / fp32_set_opt_dtype / fp32_append_dtype policies)",
        "promote": "promoted to the widest input dtype (promote policy)",
    }[kind]
    lines = [
        f"# Ops torch.autocast on {device.upper()} {what}.",
        f"# Generated by benchmarks/autocast_lists.py for torch {torch.__version__.split('+')[0]}.",
        f"# Source: {source}.",
        "# Used by the benchmark's 'hmp O1, autocast lists' configuration, so that hmp",
        "# and torch.autocast are compared with the same op lists.",
    ]
    if mapped:
        lines.append("# Listed under the Python entry point that reaches the aten op: " + ", ".join(mapped) + ".")
    if dropped:
        lines.append("# Not bindable by hmp (no Python entry point reaches the aten op in this")
        lines.append("# torch; calls reach it from C++ only), so left out:")
        lines += wrap_comment(dropped)
    return "\n".join(lines + sorted(kept)) + "\n"


def wrap_comment(names, width=78):
    """``names`` as list-file comment lines of at most ``width`` characters
    (a name longer than that gets a line of its own)."""
    out, line = [], "#  "
    for n in names:
        if len(line) + len(n) + 1 > width and line != "#  ":
            out.append(line)
            line = "#  "
        line += " " + n
    out.append(line)
    return out


def generate():
    cpu = cpu_policies()
    check_against_dispatcher(cpu, "AutocastCPU")
    cuda = cuda_policies()
    check_against_dispatcher(cuda, "AutocastCUDA", extra=CUDA_BANNED)
    cpu_src = (
        "TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) in aten/src/ATen/autocast_mode.cpp, "
        "checked equal to the ops with an AutocastCPU kernel in the installed torch"
    )
    cuda_src = (
        "AT_FORALL_* macros of the installed torch/include/ATen/autocast_mode.h plus "
        "cudnn_convolution(_transpose) from autocast_mode.cpp, checked equal to the ops with an "
        "AutocastCUDA kernel in the installed torch (binary_cross_entropy is banned there)"
    )
    out = {}
    for device, policies, src in (("cpu", cpu, cpu_src), ("cuda", cuda, cuda_src)):
        for kind, names in policies.items():
            out[list_paths(device)[kind]] = render(device, kind, names, src)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs from what would be written")
    args = ap.parse_args(argv)
    stale = []
    for path, text in generate().items():
        old = path.read_text() if path.exists() else None
        if old != text:
            stale.append(path.name)
            if not args.check:
                path.write_text(text)
    if args.check:
        print("stale: " + ", ".join(stale) if stale else "autocast list files are up to date")
        return 1 if stale else 0
    print("wrote: " + (", ".join(stale) if stale else "nothing (up to date)"))
    return 0


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--check",)


if __name__ == "__main__":
    sys.exit(main())
