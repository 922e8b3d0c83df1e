"""``python -m hmp check`` and its API twin ``check_lists``: every entry of a
user's lists, property-checked against the running torch on drawn calls.

For each entry: every drawn call ran in the dtype hmp's rules give
(``expected_dtype``, or torch's own where the rules leave it to torch), no
call failed under hmp that runs in plain torch, and no finite value became
inf or NaN in a cast hmp made (what the op received, recorded). One verdict
line per entry says what the entry does; an op without a kernel for the
lower dtype says so. An entry no drawn call exercises is "skipped" and fails
the check (the line says why and what to do); an entry of the lower list that
torch.autocast computes in float32 (op_lists/autocast_*_fp32.txt: losses,
softmax, norms, linear algebra) is "flagged" with that reason. A device this
machine does not have is bad input (ValueError), not a failure of every entry.
"""

import contextlib
import difflib
import warnings
from collections import Counter
from typing import List, NamedTuple

import torch
from hypothesis import HealthCheck, Phase, given, settings

from hmp.binding import kinds
from hmp.binding.list_files import list_path, names
from hmp.core import dtypes
from hmp.driver.conversion import converted
from hmp.driver.queries import effective_lists, in_force
from hmp.testing.follows import Rejected, follow
from hmp.testing.strategies import builder, calls, op_for

OK, FAILED, SKIPPED, FLAGGED, MODULE = "ok", "FAILED", "skipped", "flagged", "module"
# the shipped data of what torch.autocast computes in float32, by device
AUTOCAST_FP32 = {"cpu": "autocast_cpu_fp32", "cuda": "autocast_cuda_fp32"}


class Verdict(NamedTuple):
    kind: str  # the list: "bf16", "fp32" or "promote"
    name: str
    status: str  # OK, FAILED, SKIPPED (not checked: fails the check), FLAGGED (ran as listed; see says) or MODULE
    says: str  # what the entry does, or what went wrong

    @property
    def ok(self):
        return self.status not in (FAILED, SKIPPED)


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
        more = "".join(f", {counts[s]} {s}" for s in (FLAGGED, MODULE) if counts[s])
        lines.append(
            f"{len(self.verdicts)} entries: {counts[OK]} ok, {counts[FAILED]} failed, {counts[SKIPPED]} skipped{more}"
        )
        if counts[SKIPPED]:
            lines.append(
                f"not checked: {', '.join(v.name for v in self.verdicts if v.status == SKIPPED)}: "
                "the check fails until every entry is exercised"
            )
        return "\n".join(lines)


def autocast_fp32():
    """``{op name: [device, ...]}``: the ops torch.autocast computes in float32
    (the shipped op_lists/autocast_cpu_fp32.txt and autocast_cuda_fp32.txt)."""
    found = {}
    for device, name in AUTOCAST_FP32.items():
        for text in names(list_path(name)):
            if "." not in text:
                found.setdefault(text, []).append(device)
    return found


def _device(device):
    """``device`` as a string; ValueError, one line, where this machine has no such device."""
    try:
        where = torch.device(device)
        torch.empty(1, device=where)
    except (RuntimeError, AssertionError, AttributeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"device {device!r} is not available on this machine ({first})") from None
    return str(where)


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
    ``examples`` drawn calls each (``only``: these names alone, a name or an
    iterable of names, each of which must be an entry: a name the lists do
    not hold raises ValueError naming it, so a typo cannot check nothing and
    pass) on ``device``. Returns a Report (``str()`` prints one line per
    entry, ``.ok``); a bad list file raises hmp.convert's error. The
    conversion in force before, and the random stream, are as they were
    afterwards."""
    low = low_precision_type
    only = _only(only)
    device = _device(device)
    autocast_keeps_fp32 = autocast_fp32()
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
        _check_only(only, detail, low)
        for kind, entries in detail.items():
            for name, why in entries.items():
                if only is not None and name not in only:
                    continue
                if why.startswith("module entry"):
                    verdicts.append(Verdict(kind, name, MODULE, f"{why} (module entries are not checked here)"))
                    continue
                verdict = _check_entry(kind, name, why, low, examples, device)
                if verdict.status == OK and kind == "bf16" and name in autocast_keeps_fp32:
                    verdict = _flag(verdict, low, autocast_keeps_fp32[name])
                verdicts.append(verdict)
        options = in_force().options
    title = kinds.LOWER.title_in(low)
    header = (
        f"hmp check: torch {torch.__version__} on {device}, opt_level {options.opt_level}, lower dtype "
        f"{dtypes.name(low)}{', strict' if options.strict else ''}; {title} list {bf16_file_path or 'default'}, "
        f"FP32 list {fp32_file_path or 'default'}; {examples} drawn calls per entry"
    )
    return Report(header, verdicts)


def _only(only):
    """``only`` as a set of names (None: every entry); a bad value raises before anything runs."""
    if only is None:
        return None
    given = [only] if isinstance(only, str) else only
    try:
        names = list(given)
    except TypeError:
        raise TypeError(f"hmp: only must be an entry's name or an iterable of names, got {only!r}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"hmp: only must hold entries' names (str), got {bad[0]!r}")
    if not names:
        raise ValueError("hmp: only names no entry, so nothing would be checked; pass None to check every entry")
    return set(names)


def _check_only(only, detail, low):
    """ValueError naming each name of ``only`` that no list in ``detail`` holds, with close matches."""
    if only is None:
        return
    held = sorted({name for entries in detail.values() for name in entries})
    missing = sorted(only.difference(held))
    if not missing:
        return
    said = []
    for name in missing:
        close = difflib.get_close_matches(name, held, n=3)
        said.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    lists = ", ".join(f"{kinds.kind(k).title_in(low)} ({len(v)} entries)" for k, v in detail.items())
    raise ValueError(
        f"hmp: no entry of the lists is named {' or '.join(said)}, so nothing would be checked for "
        f"{'it' if len(missing) == 1 else 'them'}; the lists checked: {lists} (hmp.effective_lists() shows them)"
    )


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
    if op is None:
        return Verdict(kind, name, SKIPPED, f"{why}; not checked: no Python function reaches it in this torch")
    if builder(name) is None:
        return Verdict(
            kind,
            name,
            SKIPPED,
            f"{why}; not checked: hmp.testing.strategies has no sample calls for it (no builder, no probe call runs); "
            f"test it yourself with calls(op, build=lambda g: (args, kwargs)), or remove it from the list",
        )
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


def _flag(verdict, low, devices):
    kind = "a loss" if verdict.name.endswith("_loss") or verdict.name.endswith("cross_entropy") else "an op"
    return verdict._replace(
        status=FLAGGED,
        says=f"{verdict.says}; but torch.autocast computes it in float32 (on {' and '.join(devices)}): "
        f"{kind} moved to {dtypes.name(low)} (op_lists/{AUTOCAST_FP32[devices[0]]}.txt)",
    )


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
