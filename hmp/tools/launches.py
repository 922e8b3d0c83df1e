"""What a call costs a GPU, counted on any machine: kernel launches and host reads.

On a GPU each dispatched op that computes is a kernel launch (several microseconds of host time), and
batch-1 work is bound by them; on a CPU the same op costs about a microsecond. So the count, taken on
``meta`` tensors (nothing runs) or CPU tensors, says what a GPU will pay where a CPU timing cannot:

    >>> from hmp.tools.launches import count
    >>> count(F.linear, x, w).kernels          # x, w on "meta"

An op counts as a kernel unless it only makes a view (its schema: every output aliases an input
it does not write) or only allocates (``empty``, ``new_empty``: no tag marks them, so by name).
``_local_scalar_dense`` (``.item()``) is a host read: on a GPU a copy to the host and a wait.
hmp's own op ``hmp::to_finite`` counts as the kernels its CUDA implementation runs
(saturating_cast.cuda_kernels): one for a float32 contiguous source, the four stock ops otherwise.
"""

import collections
import dataclasses

from hmp.binding import aten
from hmp.binding.aten import makes_view
from hmp.core import saturating_cast, torch_private

_ALLOCATES = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")
_HOST_READ = "_local_scalar_dense"
_schema = torch_private.overload_schema


@dataclasses.dataclass
class Launches:
    """The work one call dispatched: ``kernels`` (launches on a GPU), ``host_reads`` (syncs on a
    GPU), ``ops`` (op name -> kernels), and ``result``, what the call returned."""

    kernels: int
    host_reads: int
    ops: collections.Counter
    result: object = None


def kernels_of(op, args, kwargs):
    """The kernel launches one dispatched op makes on a GPU."""
    name = _schema(op).name.split("::")[-1]
    if op is saturating_cast.op:
        dtype = args[1] if len(args) > 1 else kwargs["dtype"]
        return saturating_cast.cuda_kernels(args[0], dtype)
    if name == _HOST_READ or name in _ALLOCATES or makes_view(op):
        return 0
    return 1


def count(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and count what it dispatched (``Launches``). Nothing of the call's
    is kept: each op is counted as it is dispatched (a kept tensor would change what caches hold)."""
    ops = collections.Counter()
    reads = 0

    def seen(op, a, k):
        nonlocal reads
        if _schema(op).name.endswith(_HOST_READ):
            reads += 1
        n = kernels_of(op, a, k)
        if n:
            ops[str(op).removesuffix(".default")] += n

    result = aten.dispatched(fn, seen, *args, **kwargs)
    return Launches(sum(ops.values()), reads, ops, result)
