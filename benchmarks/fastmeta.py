"""Meta tensors whose ops cost what torch's C++ dispatcher costs: host time, with every kernel free.

torch/_meta_registrations.py registers Python meta functions (references, decompositions) on the Meta
key of about 1300 aten ops, over the C++ meta kernels most of them also have: a meta ``add`` then runs
~100 us of Python where the C++ one takes ~1 us, and a GPU's host pays ~10 us to launch it. ``install()``
drops that Python library and registers its functions again only for the ops no C++ kernel serves on
meta, so timing a model on meta tensors times what a GPU's host does for it (the Python of the model,
of a wrapper such as hmp's, and torch's dispatch), not torch's Python stand-ins for kernels.

Process-wide and for good (there is no uninstall): benchmarks/hostcost.py installs it in its own process.
Ops that keep a Python meta function (native_layer_norm, rms_norm, sdpa's math path ...) still cost
their Python: time cases whose meta kernels are C++ (linear, mm, matmul, softmax, casts).
"""

import torch
from torch._decomp import global_decomposition_table
from torch._ops import OpOverload

# served by C++ kernels on meta that the key checks below do not report (so not registered again)
_CPP_SERVED = frozenset(
    {
        "aten::empty_strided",
        "aten::clone",
        "aten::_to_copy",
        "aten::copy_",
        "aten::constant_pad_nd",
        "aten::rot90",
        "aten::as_strided_scatter",
    }
)
# a C++ kernel under one of these keys serves a meta tensor
_CPP_KEYS = ("Meta", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")

_installed = {}  # what install() did, once per process


def _has_kernel(name, key):
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def _python_meta_functions():
    """aten op -> the Python function torch would run on meta for it (a meta registration first,
    then a decomposition)."""
    table = {}
    for kind in ("meta", "post_autograd", "pre_autograd"):
        for op, fn in global_decomposition_table[kind].items():
            if isinstance(op, OpOverload) and op.name().startswith("aten::"):
                table.setdefault(op, fn)
    return table


def install():
    """Put torch's C++ meta kernels back (once per process). Returns ``{"python": n, "cpp": m,
    "refused": k}``: ops left to a Python meta function, ops now served by C++, and Python functions
    the dispatcher refused to take back (those ops then have no meta kernel). Raises RuntimeError
    where this torch keeps its Python meta kernels somewhere else."""
    if _installed:
        return dict(_installed["counts"])
    import torch._meta_registrations as registrations

    table = _python_meta_functions()  # read before the library goes: it holds the same functions
    library = getattr(registrations, "_meta_lib_dont_use_me_use_register_meta", None)
    if library is None:
        raise RuntimeError(f"torch {torch.__version__} has no _meta_lib_dont_use_me_use_register_meta: no fastmeta")
    library._destroy()
    ours = torch.library.Library("aten", "IMPL", "Meta")
    counts = {"python": 0, "cpp": 0, "refused": 0}
    for op, fn in table.items():
        name = op.name()
        if op.is_view or name in _CPP_SERVED or _has_kernel(name, "CompositeImplicitAutograd"):
            continue  # decomposes above the Meta key, or a C++ kernel serves it
        if any(_has_kernel(name, key) for key in _CPP_KEYS):
            counts["cpp"] += 1
            continue
        try:
            ours.impl(op, fn)
            counts["python"] += 1
        except RuntimeError:
            counts["refused"] += 1
    _installed.update(counts=counts, library=ours)  # the Library lives as long as the process
    return dict(counts)


def installed():
    """Whether install() ran in this process."""
    return bool(_installed)
