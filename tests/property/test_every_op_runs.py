"""No op fails under hmp because it was given a lower-precision tensor.

An op in no hmp list is not wrapped, so it can receive the bfloat16 (float16) output of a listed op.
hmp's rule for it: an op with no kernel for that dtype (op_lists/no_kernel_*.txt), or one that
needs all its floating inputs in one dtype (op_lists/one_dtype.txt), runs as it would have without
hmp's cast. The proof sweeps every op of torch's OpInfo database (benchmarks/kernel_lists.py, the
generator of those files): each float32 CPU sample that runs in plain torch is called again, under
``hmp.converted()`` with the default lists, with its floating tensors all lowered, only the first
lowered, and all but the first lowered, through the op's public Python name (so through hmp's
wrappers). None may raise.

Ops hmp cannot wrap (named in the files' headers as left out: ``torch.sparse.mm``, which no name
hmp binds reaches, and ``view_as_complex``, a view, which hmp never casts) cannot be helped by
hmp; their failures are reported as a warning, not failed on. The same sweep without hmp found
the files' names (``python benchmarks/kernel_lists.py --check``).
"""

import warnings

import pytest
import torch
from helpers import benchmark

import hmp
from hmp.binding import list_files
from hmp.binding.resolve import BOUND, UNKNOWN, Resolver

kl = benchmark("kernel_lists.py", "hmp_kernel_lists")


@pytest.fixture(scope="module")
def sweep():
    """Every OpInfo's float32 CPU samples that run in plain torch (hmp not converted)."""
    pytest.importorskip("expecttest", reason="torch's OpInfo database (torch.testing._internal) needs expecttest")
    hmp.revert()
    with kl.one_thread():
        return kl.collect_probes()


def unreachable():
    """OpInfo keys the list files' headers name as left out: no Python name hmp binds reaches
    them (``torch.sparse.mm``), or hmp refuses their name in a list (a view: ``view_as_complex``)."""
    return set().union(*(kl.read(kind).dropped for kind in kl.FILES))


def failures_under_hmp(sweep, low, **convert_kwargs):
    """``{OpInfo key: [Finding]}``: the lower-precision calls that raise under
    ``hmp.converted(low_precision_type=low, **convert_kwargs)``. A call whose error is not about
    dtypes (a matrix that rounding made singular) counts only where plain torch raises no error
    for the same call."""
    with kl.one_thread(), hmp.converted(low_precision_type=kl.LOWER[low], **convert_kwargs):
        findings = kl.probe_errors(sweep.probes, lows=(low,))
    by_key = {p.key: p for p in sweep.probes}
    out = {}
    for f in findings:
        if not f.counted and kl.probe_errors([by_key[f.key]], lows=(low,)):
            continue  # plain torch raises too (this probe_errors runs after the converted block)
        out.setdefault(f.key, []).append(f)
    return out


def report(sweep, failed, low):
    resolver = Resolver()
    lines = []
    for key in sorted(failed):
        name = kl.list_name(sweep.ops[key], resolver) or "(no list name)"
        first = failed[key][0]
        variants = ", ".join(sorted({f.variant for f in failed[key]}, key=kl.VARIANTS.index))
        lines.append(f"  {name} (OpInfo {key}) [{variants}]: {first.error}")
    return (
        f"{len(failed)} ops raise under hmp.converted(low_precision_type={kl.LOWER[low]}) where float32 runs "
        f"(torch {torch.__version__}):\n" + "\n".join(lines)
    )


@pytest.mark.slow  # under a minute for both: the float32 sweep (shared) takes most of it
@pytest.mark.torch_internals
@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_every_op_runs_with_lower_precision_inputs(sweep, low):
    assert len(sweep.ops) > 400, f"the sweep probed only {len(sweep.ops)} OpInfos: {sweep.not_probed}"
    failed = failures_under_hmp(sweep, low)
    skipped = {key: failed.pop(key) for key in unreachable() & set(failed)}
    if skipped:
        warnings.warn(
            f"ops the list files leave out (hmp cannot wrap them) raise with {low} inputs: "
            + "; ".join(f"{k}: {v[0].error}" for k, v in sorted(skipped.items())),
            UserWarning,
            stacklevel=2,
        )
    assert not failed, report(sweep, failed, low)


def test_list_files_are_sorted_and_every_name_binds():
    resolver = Resolver()
    here = kl.release()
    for kind, filename in kl.FILES.items():
        path = kl.LIST_DIR / filename
        names = list_files.names(path)
        assert names, path
        assert names == sorted(set(names)), f"{filename}: not sorted or has duplicates"
        listed = kl.read(kind)
        assert list(listed.names) == names
        bad = []
        for name in names:
            status = status_of(resolver, name)
            lacking = listed.names[name]
            # a name some merged release lacks (an op newer or older than this torch) is marked so;
            # on a merged release the mark must name it
            if status == BOUND or (status == UNKNOWN and lacking and (here in lacking or here not in listed.releases)):
                continue
            bad.append(f"{name} ({status}{', marked ' + kl.NOT_IN + ', '.join(sorted(lacking)) if lacking else ''})")
        assert not bad, f"{filename}: names hmp does not bind on torch {here}: {', '.join(bad)}"
        refused = [
            f"{name}: {kl.refusal(name)}" for name in names if status_of(resolver, name) == BOUND and kl.refusal(name)
        ]
        assert not refused, f"{filename}: names hmp refuses in a list: {'; '.join(refused)}"


def status_of(resolver, name):
    return resolver.check(name, hint=False)[1]
