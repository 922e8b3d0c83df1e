"""Which torch release has what hmp relies on: ``BOUNDARIES``, one row per private name
or behaviour whose shape changes between releases, with its first release and what
hmp does without it. docs/torch-releases.md shows the table (tests/unit/core/test_torch_private.py
keeps them equal); skipped tests read their reason from it; ``release_lacks()`` says
what the running release cannot give. Presence is asked in torch_private.py (``PRESENT``)."""

import re
from typing import NamedTuple

from hmp.core import torch_private

VERSION = torch_private.VERSION


def release(version):
    """``(major, minor, patch)`` of a torch version string ("2.15.0+cu132")."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(p or 0) for p in found.groups()) if found else (0, 0, 0)


class Boundary(NamedTuple):
    what: str  # the private name or behaviour hmp relies on
    first: str  # the first release that has it ("2.4": the floor and every release since)
    without: str  # what hmp does on a release without it
    promise_kept: bool  # whether hmp keeps its promise without it; False: convert() says what it cannot keep
    present: bool  # on the running torch


def _boundary(what, first, without, promise_kept=True, present=None):
    return Boundary(
        what, first, without, promise_kept, release(VERSION) >= release(first) if present is None else present
    )


PRESENT = torch_private.PRESENT
FLOOR = "2.4"
BOUNDARIES = {
    "compile_session": _boundary(
        "torch.compiler._compile_session_context: the compile flag held from capture to the compiled graph",
        "2.13",
        "the session is dynamo's CompileContext (torch._guards), held as long: the same rule",
        present=PRESENT["compile_session"],
    ),
    "thread_local_reads": _boundary(
        "dynamo traces an attribute of a threading.local as the running thread's value",
        "2.12",
        "hmp's thread state keeps no class attribute, so there is no other value to read",
    ),
    "traced_state_writes": _boundary(
        "dynamo traces a write to a threading.local without a graph break and guards on it",
        "2.6",
        "a compiled graph breaks where hmp's thread state changes (module entries, @hmp.fp32_function, "
        "disable_casts() inside compiled code) and is not compiled again when it changes: compile after convert()",
        promise_kept=False,
    ),
    "dynamo_traces_wrappers_fully": _boundary(
        "dynamo traces a disable_casts() block and a wrapper's call of a Tensor method (torch 2.6's does not)",
        "2.7",
        "disable_casts() inside compiled code breaks the graph, inductor can fail on a converted model "
        "(\"'method_descriptor' object has no attribute '__module__'\"), and a compile that fails may leave "
        'casts off in its thread: on 2.6 use backend="aot_eager", or torch 2.7 or newer',
        promise_kept=False,
    ),
    "dynamo_forgets_wrappers": _boundary(
        "dynamo forgets the wrappers it met while converted once revert() puts torch's functions back",
        "2.6",
        "after a second convert() in one process, a compiled graph breaks where the first conversion's wrappers "
        "stood, and the op there may run uncast: compile in the process's first conversion",
        promise_kept=False,
    ),
    "inline_nn_modules": _boundary(
        "dynamo traces torch.nn modules' forwards (torch._dynamo.config.inline_inbuilt_nn_modules by default)",
        "2.5",
        "a module's forward first runs when the captured graph is lowered, and hmp casts there: what a module "
        "entry, @hmp.fp32_function or disable_casts() declares inside a compiled model may compute in bf16",
        promise_kept=False,
    ),
    "export_without_dynamo": _boundary(
        "torch.export.export traces the program without dynamo by default (strict=False)",
        "2.8",
        "export's default traces through dynamo, which keeps an FP32 entry or disable_casts() inside the program "
        "only in part: export with strict=False, which hmp follows on every release",
        promise_kept=False,
    ),
    "traced_autocast_switch": _boundary(
        "dynamo traces torch.set_autocast_enabled(device, enabled): the switch engine='autocast' makes around "
        "each call hmp runs itself (2.11 does not; 2.12 was not tested)",
        "2.13",
        "under engine='autocast' a compiled graph breaks at each call hmp runs itself, and fullgraph=True raises: "
        "compile with engine='python' (the default) on these releases",
        promise_kept=False,
    ),
    "autograd_cache": _boundary(
        "torch._functorch.config.enable_autograd_cache: AOTAutograd's cache, keyed without hmp's state",
        "2.5",
        "nothing to turn off",
        present=PRESENT["autograd_cache"],
    ),
    "compiling_flag": _boundary(
        "torch.compiler._is_compiling_flag and _is_exporting_flag: set while dynamo or export traces",
        FLOOR,
        "read as False (hmp then decides compiled code as eager code)",
        present=PRESENT["compiling_flag"],
    ),
    "tracing_state": _boundary(
        "torch._C._get_tracing_state: set while torch.jit.trace records",
        FLOOR,
        "read as None: a traced program would record the weight-cast cache's copies as constants",
        present=PRESENT["tracing_state"],
    ),
    "graph_task_id": _boundary(
        "torch._C._current_graph_task_id: -1 outside a backward pass",
        FLOOR,
        "an autograd device thread casts until a region says not",
        present=PRESENT["graph_task_id"],
    ),
    "functorch_transforms": _boundary(
        "torch._C._are_functorch_transforms_active: vmap/grad/jvp in progress",
        FLOOR,
        "read as False: the weight-cast cache would key on tensors without storage",
        present=PRESENT["functorch_transforms"],
    ),
    "version_counter_reset": _boundary(
        "torch._C._autograd._unsafe_set_version_counter: the one way torch writes and keeps a version",
        FLOOR,
        "a refill that keeps the version counter is not seen by the weight-cast cache",
        promise_kept=False,
        present=PRESENT["version_counter_reset"],
    ),
    "checkpoint_generator": _boundary(
        "torch.utils.checkpoint's non-reentrant generator (renamed ..._impl in 2.14)",
        FLOOR,
        "non-reentrant checkpoint recomputes are not kept cast (checkpoint_lacks)",
        promise_kept=False,
        present=PRESENT["checkpoint_generator"],
    ),
    "record_function_exit": _boundary(
        "torch.ops.profiler._record_function_exit: where record_function blocks close",
        FLOOR,
        "an optimizer step that raises leaves casts off in its thread until revert() (step_lacks)",
        promise_kept=False,
        present=PRESENT["record_function_exit"],
    ),
    "jit_builtins": _boundary(
        "torch.jit._builtins' table: a wrapper scripts as the builtin it wraps",
        FLOOR,
        "none: torch.jit.script of a converted model would fail",
        promise_kept=False,
        present=PRESENT["jit_builtins"],
    ),
}


# said by their rules' own lines (checkpoint_lacks, step_lacks)
_SAID_BY_RULES = ("checkpoint_generator", "record_function_exit")


def release_lacks():
    """Lines for what this torch cannot give that hmp promises, said once per
    process at convert() ([] on the releases that have everything)."""
    return [
        f"hmp: torch {VERSION} predates {b.first} ({b.what}), so {b.without}"
        for key, b in BOUNDARIES.items()
        if not b.present and not b.promise_kept and key not in _SAID_BY_RULES
    ]


def table_rows():
    """The table as docs/torch-releases.md shows it, one Markdown row per boundary."""
    return [
        f"| `{key}` | {b.what} | {b.first} | {b.without} | {'yes' if b.promise_kept else 'no: convert() warns'} |"
        for key, b in BOUNDARIES.items()
    ]
