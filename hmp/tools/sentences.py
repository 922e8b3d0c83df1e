"""Every sentence of hmp.tune's and hmp.audit's verdict and "what to do",
as a function of the numbers recorded on the same page.

A verdict is given only where its interval lies wholly on one side of
the threshold it is judged against; otherwise the sentence says that it
cannot tell yet and how much longer to run:

- speed: worded in speed.py, the one home of every speed sentence (a
  verdict only where the machine let the runs be measured and the control
  agreed, else why and how to get one);
- loss: the tuned lists' loss relative to fp32's over the last half of the
  validation steps (``loss_gaps``) against the tolerance: every step within
  it, within; every step outside it, outside; some of each, "cannot tell
  yet", with the ``--steps`` to try;
- the files: described from their lines (tuned_files.split: the starting
  lists' own lines and tune's changes), never assumed empty.

The functions take a TuneResult or an AuditReport, or the plain numbers,
and return text (the report's page escapes it); tests feed them recorded
data with known numbers.
"""

import math

from hmp.binding import kinds
from hmp.tools import speed
from hmp.tools.report.svg import _num, esc

DEFAULT_FILES = ("tuned_bf16.txt", "tuned_fp32.txt")
WITHIN, OUTSIDE, UNKNOWN = "within", "outside", "cannot tell yet"


# --- loss -----------------------------------------------------------------------------------------------------------


def loss_state(gaps, tolerance):
    """WITHIN when every gap (relative to fp32's loss) is within ``tolerance``, OUTSIDE when every one
    is outside it (or not finite), else UNKNOWN."""
    sizes = [abs(g) if math.isfinite(g) else math.inf for g in gaps]
    if max(sizes) <= tolerance:
        return WITHIN
    if min(sizes) > tolerance:
        return OUTSIDE
    return UNKNOWN


def loss_sentence(gaps, tolerance, steps, start_gap):
    """The tuned lists' loss against the tolerance, from ``gaps`` (the last of them the final step's)."""
    state = loss_state(gaps, tolerance)
    final = gaps[-1]
    over = ""
    if len(gaps) > 1:
        over = f", and {min(gaps):+.2%} to {max(gaps):+.2%} over the last {len(gaps)} of {steps} steps"
    said = (
        f"training under the tuned lists ends {final:+.2%} from fp32's loss{over} "
        f"(the starting lists: {start_gap:+.2%})."
    )
    if state == WITHIN:
        return f"Within the {tolerance:.0%} tolerance: {said}"
    if state == OUTSIDE:
        return f"Outside the {tolerance:.0%} tolerance: {said}"
    return (
        f"Cannot tell yet whether the tuned lists stay within the {tolerance:.0%} tolerance: {said} "
        f"Some of those steps are within it and some outside: run longer (--steps {2 * steps}) to tell."
    )


# --- the files ------------------------------------------------------------------------------------------------------


def _names(lines, shown=8):
    more = len(lines) - shown
    return ", ".join(lines[:shown]) + (f" and {more} more" if more > 0 else "")


def file_words(path, parts):
    """What a written file holds, from its lines (tuned_files.split's ``{"start", "tune"}``; ``"whole"``: the
    whole list, replacing the default as the starting list did)."""
    start, tune = parts["start"], parts["tune"]
    if parts.get("whole"):
        held = [f"{len(start)} entr{'y' if len(start) == 1 else 'ies'} of the list you started from ({_names(start)})"]
        held += [f"{len(tune)} of tune's ({_names(tune)})"] if tune else []
        dropped = parts.get("dropped") or []
        held += [f"without {len(dropped)} tune took out ({_names(dropped)})"] if dropped else []
        return f"{path}: the whole list, replacing the default as the list you started from did: " + ", ".join(held)
    if not start and not tune:
        return f"{path}: include default and nothing else"
    held = []
    if start:
        held.append(f"{len(start)} line{'s' * (len(start) != 1)} of the lists you started from ({_names(start)})")
    if tune:
        held.append(f"{len(tune)} of tune's ({_names(tune)})")
    return f"{path}: include default, then " + " and ".join(held)


def files_sentence(tune, paths):
    """The files (written or to write) described from their lines."""
    parts = tune.file_parts()
    files = (kinds.LOWER.name, kinds.FP32.name)  # tune writes the lower list's file and the FP32 one
    return "; ".join(file_words(path, parts[kind]) for kind, path in zip(files, paths)) + "."


# --- tune -----------------------------------------------------------------------------------------------------------


def tune_outcome(tune):
    """The tune page's verdict: ``(state, [sentences])``, state WITHIN, OUTSIDE or UNKNOWN."""
    gaps = tune.loss_gaps("tuned lists")
    state = loss_state(gaps, tune.tolerance)
    first = loss_sentence(gaps, tune.tolerance, tune.steps or len(gaps), tune.loss_gap("starting lists"))
    said = speed.speed_sentence(
        tune.ratio("tuned lists"), "a step under the tuned lists", speed.more_rounds(tune.rounds)
    )
    out = [first, said]
    if state == OUTSIDE:
        if not tune.audit.flagged and not tune.modules_to_fp32:
            why = (
                "No op is over the thresholds alone: the loss drifts from many ops' rounding together, which "
                "moving single ops does not fix."
            )
        else:
            why = "Tune kept no change that made the loss worse than the starting lists'."
        out.append(
            why + " Put the model's most sensitive module classes in the FP32 list (the module table below), "
            "or validate over more steps."
        )
    return state, out


def change_reasons(tune):
    """Each change tune made, with why it is there: ``[sentence]``."""
    flagged = {r["op"]: r["reason"] for r in tune.audit.rows}
    out = [
        f"{op} to the FP32 list: flagged by the audit ({flagged.get(op) or 'over the bounds'})"
        for op in tune.moved_to_fp32
    ]
    for op, p in tune.proposals.items():
        if p["accepted"]:
            out.append(
                f"{p['class']} to the FP32 list, instead of moving {op}: {op}'s error is confined to it (with it in "
                f"FP32, {op} cast everywhere else makes error {_num(p['own_max_rel'], 2)} and moves the loss by "
                f"{_num(p['loss_error'], 2)})"
            )
    for p in tune.module_proposals.values():
        if p["accepted"]:
            out.append(
                f"{p['class']} to the FP32 list: its own code makes error {_num(p['made_max_rel'], 2)}, over the "
                f"threshold {tune.audit.threshold:g}, with the flagged ops moved"
            )
    for op in tune.added_to_bf16:
        why = tune.trials.get(op, {}).get("why") or "kept in bf16"
        out.append(f"{op} to the BF16 list: {why.removeprefix('kept: ')}")
    return out


def _p(text):
    return f"<p>{esc(text)}</p>"


def tune_todo(tune):
    """What to do, agreeing with the verdict: nothing, the changes with their reasons and the call that
    loads them; outside the tolerance, not to use them; where it cannot tell, to run longer. HTML."""
    bf16, fp32 = tune.written or DEFAULT_FILES
    call = f"hmp.convert(bf16_file_path={bf16!r}, fp32_file_path={fp32!r})"
    reasons = change_reasons(tune)
    held = files_sentence(tune, (bf16, fp32))
    if tune.written:
        files = f"Files written: {bf16} (the BF16 list) and {fp32} (the FP32 list): "
    else:
        files = f"Write the files first: result.write({bf16!r}, {fp32!r}); they would hold: "
    files += held
    listed = '<ul class="changes">' + "".join(f"<li>{esc(r)}</li>" for r in reasons) + "</ul>"
    reference = [_p("What the files hold, for reference:"), listed] if reasons else []
    state = loss_state(tune.loss_gaps("tuned lists"), tune.tolerance)
    if state == OUTSIDE:
        return [
            _p(
                "Do not use the tuned lists as they are: training under them ends outside the tolerance. Put the "
                "model's most sensitive module classes in the FP32 list (the module table below) and run tune "
                "again, or validate over more steps (--steps)."
            ),
            *reference,
            _p(files),
        ]
    if state == UNKNOWN:
        return [
            _p(
                "Not yet: the validation is too short to tell whether the tuned lists stay within the tolerance. "
                f"Run tune again with --steps {2 * (tune.steps or len(tune.loss_gaps('tuned lists')))}."
            ),
            *reference,
            _p(files),
        ]
    slower = speed.slower_words(tune.ratio("tuned lists"), getattr(tune, "matmul", None))
    if not reasons:
        return [
            _p(
                "Nothing to change in the lists: tune kept no change to them (nothing flagged moved, no op added). "
                + files
            ),
            *([_p(slower)] if slower else []),
            *([_p(tune.authored_words().capitalize() + ".")] if tune.authored else []),
        ]
    return [
        f"<p>{len(reasons)} change{'s' * (len(reasons) != 1)} from the starting lists, each with why it is there:</p>",
        listed,
        f"<p>{esc(files)} Use them:</p>",
        f'<pre class="call">{esc(call)}</pre>',
        *([_p(slower)] if slower else []),
    ]


# --- audit ----------------------------------------------------------------------------------------------------------


def audit_outcome(audit):
    """The audit page's verdict: ``(state, [sentences])``; the speed sentence from the same ratio as the
    op rows' times add up to (op_costs.op_times: the same runs, the ops timed on both sides)."""
    flagged = audit.flagged + audit.flagged_modules
    if flagged:
        first = (
            f"{len(audit.flagged)} op(s) and {len(audit.flagged_modules)} module class(es) flagged: their bf16 "
            f"error is over the thresholds ({', '.join(flagged)})."
        )
    else:
        first = (
            f"Nothing flagged: each op cast alone stays under the error threshold {audit.threshold:g} and the loss "
            f"threshold {audit.loss_threshold:g}, with no inf/NaN."
        )
    return (OUTSIDE if flagged else WITHIN), [
        first,
        f"After one step under the lists the loss is {_num(audit.output_error)} off fp32's (relative).",
        speed.speed_sentence(audit.time_ratio, "the listed ops' forward time under the lists" + timed_ops(audit)),
    ]


def timed_ops(audit):
    """`` (conv2d, linear: the rows timed in both runs)``: the op set the speed sentence covers."""
    names = sorted(r["op"] for r in audit.rows if r.get("time_ratio") is not None)
    return f" ({', '.join(names)}: the ops timed in both)" if names else ""


def audit_todo(audit):
    if not (audit.flagged or audit.flagged_modules):
        return ["<p>Nothing to change: the lists in force suit this step.</p>"]
    return [
        "<p>Let tune move the flagged ops (or their module classes) to FP32 and check the result by training:</p>",
        '<pre class="call">python -m hmp tune TARGET --report tune.html</pre>',
        "<p>or put them in an FP32 list file (<code>include default</code>, then one name a line) and pass it "
        "as <code>hmp.convert(fp32_file_path=...)</code>.</p>",
    ]


def bounds_broken(row, threshold, loss_threshold):
    """Which of the audit's bounds an op's trial or row broke, each in a few words
    (a chart's cell and tune's outcome say them alike)."""
    why = []
    if not row["own_max_rel"] <= threshold:
        why.append(f"error {_num(row['own_max_rel'], 2)} > {threshold:g}")
    if not row["loss_error"] <= loss_threshold:
        why.append(f"loss error {_num(row['loss_error'], 2)} > {loss_threshold:g}")
    if row["nonfinite"]:
        why.append("inf/NaN")
    return why
