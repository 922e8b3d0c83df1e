"""Every sentence hmp's tools (the demo, tune, audit, profile) print or
draw about speed, from the numbers measured (timing.Ratio, host.Sample).

Three outcomes, never confused:

- a measured difference: ``0.62x fp32's time (middle half of 10 pairs:
  0.58x to 0.66x)``, only where timing.Ratio.measurable says so;
- ``no measurable difference``: the machine let the runs be compared, and
  the difference is within the margin, or the pairs disagree (the sentence
  says which, with the range);
- ``could not measure here``: other programs took too much of the runs (the
  pairs' threads waited for a CPU, a hypervisor stole it) or the control,
  the same lists timed twice, disagreed: the sentence says which, with the
  counts, and how to get a measurement (an idle machine; more pairs).

What is timed, and where: on a CPU, each run's wall clock between device
synchronisations; on a CUDA GPU, the device's time between events around
the run (host.measure). On either, a run counts only when it lost at most
the margin of its time to other programs: a GPU's step waits on its host
as soon as it is launch-bound, so the same check applies there.
"""

from __future__ import annotations

import statistics

from hmp.tools import timing
from hmp.tools.timing import MARGIN, MIN_PAIRS

UNCLEAR = "no measurable difference"
NOT_HERE = "could not measure here"


# --- one comparison ---------------------------------------------------------------------------------------------


def direction(ratio):
    """``faster``, ``slower``, UNCLEAR, or NOT_HERE where the machine did not let it be judged."""
    if ratio is not None and not ratio.judged:
        return NOT_HERE
    return "faster" if ratio is not None and ratio.faster else "slower" if ratio and ratio.slower else UNCLEAR


def middle_half(ratio):
    """``middle half of 10 pairs: 0.58x to 0.66x`` (or why there is none)."""
    if ratio.pairs < MIN_PAIRS:
        return f"{ratio.pairs} pair{'s' * (ratio.pairs != 1)}, too few to tell"
    return f"middle half of {ratio.pairs} pairs: {ratio.low:.2f}x to {ratio.high:.2f}x"


def load_words(load):
    """What the machine did during the pairs: ``this process's threads waited for a CPU 31% of the runs'
    time, up to 5 tasks runnable on 2 CPUs, this process's included, torch ran 2 threads`` (empty without
    a Load)."""
    if load is None:
        return ""
    said = []
    if load.waited is None:
        said.append("this host does not report how long its threads wait for a CPU")
    else:
        said.append(f"this process's threads waited for a CPU {load.waited:.0%} of the runs' time, on average")
    if load.stolen and load.stolen >= 0.005:
        said.append(f"the hypervisor took {load.stolen:.0%} of the machine's CPU time (steal)")
    if load.runnable is not None:
        cpus = f"{load.cpus} CPU{'s' * (load.cpus != 1)}"
        said.append(f"up to {load.runnable} tasks runnable on {cpus}, this process's included")
    if load.threads is not None:
        said.append(f"torch ran {load.threads} thread{'s' * (load.threads != 1)}")
    return ", ".join(said)


def how_to_measure(longer=None):
    """How to get a measurement where the machine did not let one be made."""
    more = f", or run longer ({longer}): only the pairs no other program delayed count" if longer else ""
    return f"for a measurement, run on an idle machine (stop other programs and jobs){more}"


def busy_words(ratio):
    """Why a busy comparison (timing.Ratio.busy) was not judged: the pairs other programs delayed."""
    load = ratio.load
    if (load.stolen or 0.0) > ratio.margin:
        return f"the hypervisor ran other machines on this one's CPUs ({load_words(load)})"
    if load.waited is None:
        return f"this host does not say whether other programs delayed the runs ({load_words(load)})"
    return (
        f"in {load.contended} of {load.taken} pairs a run lost more than {ratio.margin:.0%} of its time to other "
        f"programs ({load_words(load)})"
    )


def takes(subject, ratio, of="fp32's time"):
    """``subject takes 0.62x fp32's time (...)``, or where the machine did not let it be measured,
    ``subject against fp32: could not measure here (...)``."""
    if ratio is not None and not ratio.judged:
        against = of.removesuffix("'s time")
        return f"{subject} against {against}: {words(ratio, of)}"
    return f"{subject} takes {words(ratio, of)}"


def control_words(control):
    """``the same lists timed twice: 1.01x (middle half of 10 pairs: 0.98x to 1.03x)``, the control named as
    where it was made (Ratio.timed)."""
    what = control.timed or "the same lists"
    if control.busy:
        return f"{what} timed twice: not judged, {busy_words(control)}"
    return f"{what} timed twice: {control.median:.2f}x ({middle_half(control)})"


def not_judged_because(ratio):
    """Why the machine did not let ``ratio`` be judged (busy, or its control disagreed)."""
    if ratio.busy:
        return busy_words(ratio)
    return (
        f"the control disagreed, {control_words(ratio.control)}, not within the {ratio.margin:.0%} "
        "margin of 1.0: this machine's timing moved more than a difference could be told from"
    )


def unmeasured_because(ratio):
    """Why no difference was measured where the machine let it be judged (empty: the range says it)."""
    if ratio.pairs < MIN_PAIRS or ratio.measurable:
        return ""
    if ratio.outside_band == 0:
        if ratio.high < 1.0 or ratio.low > 1.0:
            return f"; within the {ratio.margin:.0%} margin of 1.0"
        return ""
    return (
        f"; the first half of the pairs says {ratio.first:.2f}x and the second {ratio.second:.2f}x, "
        "not the same when repeated"
    )


def words(ratio, of="fp32's time", longer=None):
    """``0.62x fp32's time (middle half of 10 pairs: 0.58x to 0.66x)``; ``no measurable difference (...)``;
    ``could not measure here (why; how to)``; ``of``: what the ratio is relative to; ``longer``: what to
    run for more pairs (``--rounds 10``). A control's spread is said with a judged comparison."""
    if ratio is None:
        return f"{UNCLEAR} (not timed)"
    if not ratio.judged:
        return f"{NOT_HERE} ({not_judged_because(ratio)}; {how_to_measure(longer)})"
    control = f"; control: {control_words(ratio.control)}" if ratio.control is not None else ""
    if not ratio.measurable:
        return f"{UNCLEAR} ({middle_half(ratio)}{unmeasured_because(ratio)}{control})"
    return f"{ratio.median:.2f}x {of} ({middle_half(ratio)}{control})"


def short(ratio):
    """The same for a table cell or a chart: ``0.62x (0.58-0.66)``, ``no measurable difference (0.95-1.04)``,
    ``not measured: machine busy`` or ``not measured: control disagreed``."""
    if ratio is None:
        return "not timed"
    if not ratio.judged:
        return "not measured: " + ("machine busy" if ratio.busy else "control disagreed")
    span = f"{ratio.low:.2f}-{ratio.high:.2f}" if ratio.pairs >= MIN_PAIRS else "too few pairs"
    return f"{ratio.median:.2f}x ({span})" if ratio.measurable else f"{UNCLEAR} ({span})"


def cell(ratio):
    """The fewest words: ``0.62x``, ``no difference``, ``not measured`` (the demo's table)."""
    if ratio is None:
        return "not timed"
    return "not measured" if not ratio.judged else f"{ratio.median:.2f}x" if ratio.measurable else "no difference"


def colour_key(ratio):
    """``faster``, ``slower`` or ``unclear``: the colour a chart draws a time in."""
    return "slower" if ratio is not None and ratio.slower else "faster" if ratio and ratio.faster else "unclear"


LEGEND = (
    "time in fp32 (grey) and under the lists: green faster, orange slower, light grey no measured difference "
    "(or not measured: other programs delayed the runs)"
)


# --- what was timed ---------------------------------------------------------------------------------------------

PAIRS = (
    "the two runs of a pair adjacent (in alternating order), so load that lasts a pair falls on both; a pair counts "
    f"only when neither run lost more than {MARGIN:.0%} of its time to other programs (its threads waiting for a "
    "CPU, steal); the median of the pairs' ratios and the spread of their middle half (below 1 is faster), a "
    f"difference stated only outside the {MARGIN:.0%} margin and where both halves of the pairs say the same"
)


def step_seconds_words(fp32_s, hmp_s):
    """The demo's sizing: what a step took, measured now (absolute, for the run's length only)."""
    return f"a step takes {fp32_s * 1e3:.0f} ms in fp32 and {hmp_s * 1e3:.0f} ms under hmp (measured now)"


def op_share(trial):
    """An op tune tried, as a share of the step it was measured in (op_costs.Costs.step_seconds: the same
    runs, recorded op by op, so never above 100 %): ``41.1% of its step``. A share, not milliseconds: the
    recorded step is slower than a plain one, and the page states one step time per configuration."""
    step = trial.get("step_seconds")
    return f"{trial['seconds'] / step:.1%} of its step" if step else "not timed"


def fp32_step(ms, steps):
    """What a tune page's ratios are relative to: fp32's median step."""
    return (
        f"fp32 step: {ms:.3g} ms (median of {steps} steps, each taken adjacent to a step of each other "
        "configuration: the pairs the ratios come from)"
    )


def recorded_steps(ms):
    """The whole steps an audit's op times are parts of (the same runs' times), for the op chart's caption."""
    if "fp32" not in ms or "lists" not in ms:
        return ""
    return (
        f" The whole step in those runs: {ms['fp32']:.3g} ms in fp32, {ms['lists']:.3g} ms under the lists "
        "(medians, recording included); each op's time is a part of it."
    )


ONE_STEP = (
    " Each op's time is a share of a step recorded op by op; the step time of each configuration is stated "
    "once, under Validation, from the paired timing."
)


def op_caption(pairs):
    """The audit op chart's words on time."""
    return (
        f"Time: the op's forward calls in a step, the median of {pairs} runs in fp32 and as many under the lists, "
        "interleaved, casts included; under the lists relative to fp32 (below 1 is faster), no measurable "
        "difference when the runs' spread says so, not measured when other programs delayed the runs."
    )


def validation_caption(fp32_step_words=""):
    """The tune page's Validation caption: how step times were taken."""
    return (
        "Final loss after training the same steps from the same state; the loss after each step is drawn below. "
        f"Step time: each configuration's steps paired with fp32's, {PAIRS}. The starting lists are timed twice, "
        "two arms: a control that must agree within the margin for any verdict. " + fp32_step_words
    )


# --- the tools' verdicts ----------------------------------------------------------------------------------------


def more_rounds(rounds):
    return f"--rounds {2 * rounds}" if rounds else None


def speed_sentence(ratio, what, longer=None):
    """``what``'s time relative to fp32 as a verdict's sentence: faster or slower where measurable; where the
    machine did not let it be judged, that, why and how to; else no measurable difference, cannot tell yet
    (``longer``: what to run to tell, ``--rounds 10``)."""
    if ratio is None:
        return f"Speed: {what} was not timed."
    if not ratio.judged:
        return (
            f"Speed: {NOT_HERE} how {what} compares with fp32: {not_judged_because(ratio)}. "
            f"{how_to_measure(longer).capitalize()}."
        )
    if ratio.measurable:
        return f"{direction(ratio).capitalize()}: {what} takes {words(ratio)}."
    more = f"; run longer ({longer}) to tell" if longer else ""
    control = f"; control: {control_words(ratio.control)}" if ratio.control is not None else ""
    return (
        f"Speed: {UNCLEAR} between {what} and fp32 ({middle_half(ratio)}{unmeasured_because(ratio)}, adjacent "
        f"pairs{control}): it cannot tell yet whether it is faster or slower{more}."
    )


def hardware_words(matmul):
    """What this machine's arithmetic in the lower dtype does, from the matrix product timed in the run
    (a timing.Ratio, or None when none was timed: then nothing is said of the hardware)."""
    if matmul is None:
        return ""
    said = takes("A matrix product in the lower dtype, timed in this run", matmul)
    if matmul.faster:
        return (
            f"{said}: this machine computes it faster, so what costs here is the rest of the step (hmp's casts "
            "and its wrappers' time per call; the op rows below show where)."
        )
    if matmul.slower:
        return f"{said}: this machine computes the lower dtype slower than fp32, so no list gains here."
    if not matmul.judged:
        return f"{said}."
    return f"{said}: the lower dtype's arithmetic gains nothing measurable here."


def slower_words(ratio, matmul):
    """Where a step under the tuned lists is measurably slower than fp32, that said with its numbers, and
    what the matrix product timed in the same run says of this machine's arithmetic."""
    if ratio is None or not ratio.slower:
        return ""
    return (
        f"On this machine a step under these lists takes {words(ratio)}: fp32 without hmp is faster here. "
        + hardware_words(matmul)
    ).strip()


def tune_verdict(ratio, rounds):
    """The speed part of TuneResult.verdict's line."""
    if ratio is None:
        return ""
    line = "; step time: " + words(ratio, longer=more_rounds(rounds))
    if ratio.judged and not ratio.measurable:
        line += ", cannot tell yet whether faster or slower" + (
            f": run longer to tell ({more_rounds(rounds)})" if rounds else ""
        )
    return line


def trial_speed(trial):
    """``(short, long)``: why an op tune tried within the bounds was kept in bf16 or not, by the step time
    with it against without (``trial["time_ratio"]``, a timing.Ratio; None: nothing was cast)."""
    ratio, than = trial.get("time_ratio"), "the time without"
    if trial["accepted"]:
        return (
            f"kept: step {ratio.median:.2f}x",
            f"kept: within the bounds, and a step with it in bf16 takes {words(ratio, than)}",
        )
    if ratio is None:
        return "casts nothing", "not kept: nothing was cast (torch runs it in its inputs' dtype, as a pointwise op)"
    if not ratio.judged:
        return "not measured here", f"not kept: a step with it in bf16 against without: {words(ratio, than)}"
    if ratio.slower:
        return f"slower: step {ratio.median:.2f}x", f"not kept: a step with it in bf16 is slower, {words(ratio, than)}"
    if ratio.surely_faster:  # faster beyond chance, by more than the op's whole time: not the op's doing
        return (
            "gain is noise",
            f"not kept: a step with it in bf16 measured {words(ratio, than)}, a gain of at least {1 - ratio.high:.1%} "
            f"of a step, more than the op's whole fp32 time ({trial['ceiling']:.2%} of a step) could give: the "
            "difference is this machine's timing, not the op",
        )
    if ratio.faster:  # the middle half below 1, but too few pairs below 1 to rule out chance
        return (
            "gain within chance",
            f"not kept: a step with it in bf16 takes {words(ratio, than)}, but only {ratio.below} of {ratio.pairs} "
            f"pairs were faster, as often as chance alone gives it (p = {ratio.chance():.2g}); more --rounds narrow it",
        )
    return "no measurable gain", f"not kept: no measurable gain; a step with it in bf16: {words(ratio, than)}"


def time_cell(ratio):
    """A tune validation row's step time relative to fp32."""
    return short(ratio)


# --- the demo ---------------------------------------------------------------------------------------------------


def expectation(matmul, native, device="cpu"):
    """The demo's line before training: what the hmp run's speed will be against fp32, and why, from the bf16
    matmul timed now (a timing.Ratio; a plain number is read against 0.9 and 1.1). On an accelerator it also
    says what the matmul alone cannot: hmp's host time per call, which only a large enough model hides."""
    has, why = native
    if isinstance(matmul, timing.Ratio):
        said = f"{takes('a bf16 matmul', matmul)} ({why})"
        faster, slower, judged = matmul.faster, matmul.slower, matmul.judged
    else:
        said = f"a bf16 matmul takes {matmul:.2f}x fp32's time ({why})"
        faster, slower, judged = matmul < 0.9, matmul > 1.1, True
    if faster:
        line = f"expect hmp to train faster than fp32 here: {said}"
    elif slower:
        line = (
            f"expect hmp to train SLOWER than fp32 here: {said}; no bf16 scheme gains on this machine. The losses "
            "and casts are still hmp's; the speed-up comes where the matmul measures faster in bf16"
        )
    elif not judged:
        line = f"no expectation of speed here: {said}"
    else:
        line = f"expect about fp32's speed here: {said}; hmp's numbers (losses, casts) are what this run shows"
    if device == "cpu":
        return line
    return (
        f"{line}. On {device} a small model is launch-bound (each call's host time, hmp's included, exceeds "
        "its kernel's) and bf16 gains nothing there: this model is sized so its matmuls outweigh that"
    )


def demo_time_line(ratio, block, warmup, device="cpu"):
    """What the demo's time column says and how sure it is."""
    timed = "the GPU's time between CUDA events" if device == "cuda" else "wall time between synchronisations"
    how = (
        f"time vs fp32: the median of the step pairs' ratios ({timed}), fp32 and hmp trained interleaved ({block} "
        f"steps of each in turn, which first alternating, after {warmup} warm-up steps); a pair counts only when "
        f"neither step lost more than {MARGIN:.0%} of its time to other programs; "
    )
    if ratio is None:
        return how + "not timed"
    if not ratio.judged:
        said = words(ratio, longer="--steps or --long")
    elif ratio.measurable:
        said = f"hmp takes {words(ratio)}: a measured difference ({load_words(ratio.load)})"
    else:
        said = f"{words(ratio)} between hmp and fp32 here (more --steps narrow it)"
    return (
        how
        + said
        + "; this column and this line are the comparison: tokens/s (each configuration's median step) and train "
        "time (its steps added up) are each configuration's own steps, which load on this machine can move apart"
    )


def demo_matmul_line(device, matmul):
    """The demo report's line on the bf16 matmul timed before training."""
    subject = "a bfloat16 matmul of the model's size"
    if isinstance(matmul, float):
        said = f"{subject} takes {matmul:.2f}x float32's time"
    else:
        said = takes(subject, matmul, "float32's time")
    return (
        f"this {device}: {said} (measured now, in adjacent pairs; below 1 is faster); no bf16 scheme gains more "
        "than that on the matmuls"
    )


# --- profile ----------------------------------------------------------------------------------------------------


def profile_noise(totals, load=None):
    """How many runs a profile's times are medians of, the middle half of the runs' totals, and what the
    machine did meanwhile (a timing.Load of the runs, None: not read)."""
    runs = len(totals)
    busy = f"; while they ran, {load_words(load)}" if load is not None else ""
    if runs < 2:
        return f"times from {runs} run after a warm-up: one run cannot say how much of a difference is noise{busy}"

    def middle(values):
        ms = sorted(v * 1e3 for v in values)
        low, _, high = statistics.quantiles(ms, n=4, method="inclusive")
        return f"{statistics.median(ms):.3f} ms (middle half {low:.3f} to {high:.3f})"

    busy_runs = (
        f"; {load.contended} of {runs} runs lost more than {MARGIN:.0%} of their time to other programs"
        if (load is not None and load.contended)
        else ""
    )
    return (
        f"times are medians of {runs} runs after a warm-up; per run, the listed ops took "
        f"{middle([op for op, _ in totals])} and hmp's casts {middle([cast for _, cast in totals])}: "
        f"a difference inside those ranges is noise{busy_runs}{busy}"
    )
