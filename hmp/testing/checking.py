"""``python -m hmp check`` and its API twin ``check_lists``: every entry of a
user's lists, property-checked against the running torch on drawn calls.

For each entry: every drawn call ran in the dtype hmp's rules give
(``expected_dtype``, or torch's own where the rules leave it to torch), no
call failed under hmp that runs in plain torch, and no finite value became
inf or NaN in a cast hmp made (what the op received, recorded). One verdict
line per entry says what the entry does; an op without a kernel for the
lower dtype says so.
"""

import contextlib
import warnings
from collections import Counter
from typing import List, NamedTuple

import torch
from hypothesis import HealthCheck, Phase, given, settings

from hmp.core import dtypes, kinds
from hmp.driver.conversion import converted, effective_lists, in_force
from hmp.testing.follows import Rejected, follow
from hmp.testing.strategies import builder, calls, op_for

OK, FAILED, SKIPPED = "ok", "FAILED", "skipped"


class Verdict(NamedTuple):
    kind: str  # the list: "bf16", "fp32" or "promote"
    name: str
    status: str  # OK, FAILED or SKIPPED
    says: str  # what the entry does, or what went wrong

    @property
    def ok(self):
        return self.status != FAILED


class Report(NamedTuple):
    header: str
    verdicts: List[Verdict]

    @property
    def ok(self):
        return all(v.ok for v in self.verdicts)

    def __str__(self):
        width = max([len(v.name) for v in self.verdicts] + [4])
        lines = [self.header]
        for v in self.verdicts:
            lines.append(f"{v.kind:<8} {v.name:<{width}}  {v.status:<7} {v.says}")
        counts = Counter(v.status for v in self.verdicts)
        lines.append(
            f"{len(self.verdicts)} entries: {counts[OK]} ok, {counts[FAILED]} failed, {counts[SKIPPED]} skipped"
        )
        return "\n".join(lines)


def check_lists(
    bf16_file_path="",
    fp32_file_path="",
    *,
    promote_file_path="",
    opt_level="O1",
    strict=False,
    low_precision_type=torch.bfloat16,
    examples=20,
    only=None,
    device="cpu",
):
    """Check every entry of the lists ``hmp.convert`` would load from these
    arguments (``""``: the environment's list, else the shipped one) on
    ``examples`` drawn calls each (``only``: these names alone) on
    ``device``. Returns a Report (``str()`` prints one line per entry,
    ``.ok``); a bad list file raises hmp.convert's error. The conversion in
    force before, and the random stream, are as they were afterwards."""
    low = low_precision_type
    kwargs = dict(
        opt_level=opt_level,
        bf16_file_path=bf16_file_path,
        fp32_file_path=fp32_file_path,
        promote_file_path=promote_file_path,
        low_precision_type=low,
        strict=strict,
    )
    verdicts = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(converted(**kwargs))
        detail = effective_lists(detail=True)
        for kind, entries in detail.items():
            for name, why in entries.items():
                if only is not None and name not in only:
                    continue
                if why.startswith("module entry"):
                    verdicts.append(Verdict(kind, name, SKIPPED, f"{why} (module entries are not checked here)"))
                    continue
                verdicts.append(_check_entry(kind, name, why, low, examples, device))
        options = in_force().options
    title = kinds.LOWER.title_in(low)
    header = (
        f"hmp check: torch {torch.__version__} on {device}, opt_level {options.opt_level}, lower dtype "
        f"{dtypes.name(low)}{', strict' if options.strict else ''}; {title} list {bf16_file_path or 'default'}, "
        f"FP32 list {fp32_file_path or 'default'}; {examples} drawn calls per entry"
    )
    return Report(header, verdicts)


def _inputs(kind, low):
    """The dtypes drawn calls of a ``kind`` entry get: what its rule changes, mixed with the rest."""
    return (low, torch.float32) if kind == "fp32" else (torch.float32, low)


class _Tally:
    def __init__(self):
        self.ran, self.rejected, self.rescued = Counter(), 0, set()

    def one(self, op, call):
        """One drawn call (raises AssertionError where it breaks a rule)."""
        args, kwargs = call
        try:
            followed = follow(op, *args, **kwargs)
        except Rejected:
            self.rejected += 1
            return
        self.ran[dtypes.name(followed.dtype) if followed.dtype else "no floating result"] += 1
        if followed.expected.rescued:
            self.rescued.add(followed.expected.rescued)


def _check_entry(kind, name, why, low, examples, device):
    op = op_for(name)
    if op is None or builder(name) is None:
        return Verdict(kind, name, SKIPPED, f"{why}; no sample calls (hmp.testing.strategies has no builder for it)")
    tally = _Tally()

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(calls(name, dtypes=_inputs(kind, low), edges=True, device=device))
    def check(call):
        tally.one(op, call)

    try:
        check()
    except Exception as e:  # hypothesis re-raises the shrunk failure, with the example in its notes
        notes = [n for n in getattr(e, "__notes__", ()) if n.startswith(("Falsifying", "Failing"))]
        example = " ".join(" ".join(notes).split())
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Verdict(kind, name, FAILED, first + (f" [{example}]" if example else ""))
    return Verdict(kind, name, OK, _says(why, low, device, tally))


def _says(why, low, device, tally):
    ran = ", ".join(f"{d} ({n})" for d, n in tally.ran.most_common()) or "no call ran"
    rejected = f"; calls torch rejects either way: {tally.rejected}" if tally.rejected else ""
    if tally.rescued:
        first = sorted(tally.rescued)[0]
        return (
            f"no {dtypes.name(low)} kernel on {device} ({first}): hmp runs it with its inputs as given and warns; "
            f"ran in {ran}{rejected}"
        )
    if why == "cast":
        return f"cast: ran in {ran}{rejected}"
    return f"{why}: ran as torch runs it, in {ran}{rejected}"
