"""What hmp.tune returns: the tuned lists, the measurements behind them,
the verdict, and the files and page they are written to."""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone

import torch

from hmp.binding import kinds
from hmp.tools import sentences, speed, timing, tuned_files
from hmp.tools.files import write_all
from hmp.tools.report.page import write as write_html
from hmp.tools.target import user_name


class TuneResult:
    def __init__(
        self,
        lists,
        before,
        audit_report,
        trials,
        validation,
        timings,
        modules=None,
        proposals=None,
        module_proposals=None,
        samples=None,
        same_as=None,
        tolerance=0.02,
        low=torch.bfloat16,
        strict=False,
    ):
        self.lists = lists  # {"bf16", "fp32", "promote"} -> sorted names
        self.before = before
        self.audit = audit_report
        self.trials = trials  # op -> {"seconds", "own_max_rel", "loss_error", "nonfinite", "accepted"}
        self.validation = validation  # name -> final loss after the validation steps
        self.timings = timings  # name -> median step seconds
        # module entries: classes and instances
        self.modules = modules or {k.name: () for k in kinds.KINDS if k.takes_modules}
        # op -> {"class", "type", "own_max_rel", "loss_error", "nonfinite", "accepted"}: the module
        # class its error is confined to, and the op's errors with that class in FP32
        self.proposals = proposals or {}
        # class path -> {"class", "type", "made_max_rel", "loss_error", "nonfinite", "accepted"}: a module
        # class whose own code makes too much error (with the flagged ops moved), and the loss error with it
        # in FP32
        self.module_proposals = module_proposals or {}
        self.samples = samples or {}  # name -> every step time measured (seconds), for the spread
        self.authored = []  # ops large enough to try, left out: the model's author computes their input in float32
        self.runs = None  # how many runs of the step tune made
        self.same_as = same_as or {}  # name -> an earlier configuration with exactly the same lists and modules
        self.tolerance = tolerance
        self.low = low  # the lower dtype: which default list the files written extend
        self.strict = strict  # strict=True: Habana's rule, whose default BF16 list the files extend
        self.written = None  # (bf16 path, fp32 path) once write() wrote them, for the page's "what to do"
        self.trajectories = {}  # name -> the loss after each validation step (the last is validation[name])
        self.steps = None  # validation steps, rounds of timing: what "run longer" doubles
        self.rounds = None
        self.start_modules = None  # the starting conversion's module entries: whose lines the files keep
        self.start_whole = frozenset()  # the kinds (public names) whose starting list replaced the default
        # name -> [(fp32 step seconds, its step seconds)]: adjacent pairs in the order taken (timing.paired)
        self.pairs = {}
        # a matrix product in the lower dtype relative to fp32, timed in pairs in the same run
        # (timing.matmul_ratio): what the page says of this machine's arithmetic; None: not measured
        self.matmul = None
        # the starting lists timed twice, two arms paired with the same fp32 steps (timing.Paired.control):
        # every step-time verdict on the page needs it to agree; None: no control was timed
        self.control = None

    def spread(self, name):
        """The relative spread of ``name``'s step times: (75th - 25th
        percentile) / median; what two medians must differ by to mean more
        than noise on this machine now. None with fewer than 4 samples."""
        times = self.samples.get(name, ())
        return timing.iqr_rel(times) if len(times) >= 4 else None

    def loss_gap(self, name):
        """``name``'s final loss relative to fp32's: (loss - fp32) / |fp32|;
        against an fp32 loss of exactly 0, 0 when equal, else signed inf."""
        diff, ref = self.validation[name] - self.validation["fp32"], abs(self.validation["fp32"])
        if ref == 0:
            return math.copysign(math.inf, diff) if diff else 0.0
        return diff / ref

    def ratio(self, name):
        """``name``'s step time relative to fp32's (timing.Ratio: below 1 is faster), from its adjacent pairs
        with fp32's steps (else the samples paired by position), with the control (the starting lists timed
        twice) that must agree for a verdict; a configuration with the same lists as an earlier one
        (``same_as``) is that one's measurement, one verdict for one set of lists. None when not timed."""
        name = self.same_as.get(name, name)
        if name in self.pairs:
            got = self.pairs[name]
            return timing.ratio([a for a, _ in got], [b for _, b in got], control=self.control)
        if name not in self.samples or "fp32" not in self.samples:
            return None
        return timing.ratio(self.samples["fp32"], self.samples[name], control=self.control)

    def loss_gaps(self, name):
        """``name``'s loss relative to fp32's (loss_gap) after each of the last half of the validation
        steps, the final one last: the interval a loss verdict is judged on (sentences.loss_state).
        Only the final one where no trajectory was recorded."""
        mine, ref = self.trajectories.get(name), self.trajectories.get("fp32")
        if not mine or not ref or len(mine) != len(ref):
            return [self.loss_gap(name)]
        gaps = []
        for a, b in list(zip(ref, mine))[len(mine) // 2 :]:
            diff = b - a
            gaps.append(diff / abs(a) if a else (math.copysign(math.inf, diff) if diff else 0.0))
        return gaps

    def loss_state(self):
        """sentences.WITHIN, OUTSIDE or UNKNOWN for the tuned lists' loss against ``tolerance``."""
        return sentences.loss_state(self.loss_gaps("tuned lists"), self.tolerance)

    @property
    def within(self):
        """The tuned lists' loss within ``tolerance`` of fp32's after every one of the last half of the
        validation steps (after the final one, where no trajectory was recorded)."""
        return self.loss_state() == sentences.WITHIN

    def file_parts(self):
        """``{kind: {"start": [...], "tune": [...]}}``: the lines the files write() writes (would write)
        hold after ``include default``, the starting lists' own and tune's changes (tuned_files.split)."""
        modules, before = {k: tuple(v) for k, v in self.modules.items()}, (self.before, self.start_modules)
        return {
            kind.name: tuned_files.split(
                kind, self.lists, modules, *before, self.low, self.strict, kind.name in self.start_whole
            )
            for kind in (kinds.LOWER, kinds.FP32)
        }

    @property
    def verdict(self):
        """One line: the tuned lists' loss against fp32's and the tolerance, and their step time, judged
        as the page judges them (sentences.loss_state, timing.Ratio.measurable): a verdict only where
        the interval lies on one side of its threshold, else cannot tell yet and what to run."""
        gaps, state = self.loss_gaps("tuned lists"), self.loss_state()
        over = f"; {min(gaps):+.2%} to {max(gaps):+.2%} over the last {len(gaps)} steps" if len(gaps) > 1 else ""
        word = {sentences.WITHIN: "within", sentences.OUTSIDE: "OUTSIDE"}.get(state, "CANNOT TELL YET against")
        line = (
            f"verdict: the tuned lists end {gaps[-1]:+.2%} from fp32's loss{over}, {word} the {self.tolerance:.0%} "
            f"tolerance (starting lists: {self.loss_gap('starting lists'):+.2%})"
        )
        if state == sentences.UNKNOWN:
            line += f"; run longer to tell (--steps {2 * (self.steps or len(gaps))})"
        if self.loss_state() == sentences.OUTSIDE:
            line += (
                "; tune kept no addition that made it worse than the starting lists, so the rest is the "
                "lower dtype's on this model: put the model's most sensitive module classes in the FP32 list "
                "(the audit's module table), or validate over more steps"
            )
        line += speed.tune_verdict(self.ratio("tuned lists"), self.rounds)
        return line

    def time_cell(self, name):
        """``name``'s step time relative to fp32 for a table: 1 for fp32, else speed.short's words."""
        return "1 (reference)" if name == "fp32" else speed.time_cell(self.ratio(name))

    def fp32_step(self):
        """What the ratios are relative to: fp32's median step and how many steps it is the median of."""
        return speed.fp32_step(self.timings["fp32"] * 1e3, len(self.samples.get("fp32", ())))

    def class_proposals(self):
        """The module classes measured again with the flagged ops moved: ``(over, under)``, the proposals
        whose own code still makes an error over the threshold, and the classes' names that no longer do."""
        threshold = self.audit.threshold if self.audit is not None else 0.0
        over = [p for p in self.module_proposals.values() if p["made_max_rel"] > threshold]
        return over, [p["class"] for p in self.module_proposals.values() if p not in over]

    def authored_words(self):
        return (
            f"not tried in bf16: {', '.join(self.authored)}, whose input the model's author computes in float32 "
            "(an .float() or .to(torch.float32) before it in the same module); tune(override_fp32=True) tries them"
        )

    @staticmethod
    def left_as_they_are(names):
        return (
            "over the threshold in the audit, but not with the flagged ops moved to FP32, so left as they are: "
            + ", ".join(names)
        )

    def class_names(self):
        """The module classes to FP32 as their author knows them (target.user_name)."""
        return [user_name(c) for c in self.modules_to_fp32]

    @property
    def moved_to_fp32(self):
        return sorted(set(self.lists["fp32"]) - set(self.before["fp32"]))

    @property
    def added_to_bf16(self):
        return sorted(set(self.lists["bf16"]) - set(self.before["bf16"]))

    @property
    def modules_to_fp32(self):
        """The module classes tune put under the FP32 rule."""
        proposed = list(self.proposals.values()) + list(self.module_proposals.values())
        return list(dict.fromkeys(p["type"] for p in proposed if p["accepted"]))

    def table(self):
        lines = [
            "## audit of the starting lists",
            "",
            self.audit.table(),
            "",
            "## ops tried in bf16",
            "",
            "| op | was in | fp32 time (share of the step it was measured in) | own max rel err | error passed to loss "
            "| inf/NaN | outcome |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for op, t in sorted(self.trials.items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(
                f"| {op} | {t['was'] or 'no list'} | {speed.op_share(t)} | {t['own_max_rel']:.3g} | "
                f"{t['loss_error']:.3g} | {t['nonfinite']} | {t.get('why') or ('kept' if t['accepted'] else 'no')} |"
            )
        if self.authored:
            lines += ["", self.authored_words()]
        if self.proposals:
            lines += [
                "",
                "## flagged ops whose error is confined to one module class",
                "",
                "| op | module class | own max rel err, class in FP32 | error passed to loss | inf/NaN | "
                "class to FP32 instead of the op |",
                "|---|---|---:|---:|---:|---|",
            ]
            for op, p in self.proposals.items():
                lines.append(
                    f"| {op} | {p['class']} | {p['own_max_rel']:.3g} | {p['loss_error']:.3g} | "
                    f"{p['nonfinite']} | {'yes' if p['accepted'] else 'no'} |"
                )
        over, under = self.class_proposals()
        if over:
            lines += [
                "",
                "## module classes whose own code makes too much error (with the flagged ops moved)",
                "",
                "| module class | error made in it | error passed to loss, class in FP32 | inf/NaN | to FP32 |",
                "|---|---:|---:|---:|---|",
            ]
            for p in over:
                lines.append(
                    f"| {p['class']} | {p['made_max_rel']:.3g} | {p['loss_error']:.3g} | {p['nonfinite']} | "
                    f"{'yes' if p['accepted'] else 'no'} |"
                )
        if under:
            lines += ["", self.left_as_they_are(under)]
        lines += [
            "",
            "## validation",
            "",
            "| lists | final loss | vs fp32's loss | step time vs fp32 (below 1 is faster) |",
            "|---|---:|---:|---:|",
        ]
        for name in self.validation:
            note = f" (same lists as {self.same_as[name]})" if name in self.same_as else ""
            lines.append(
                f"| {name}{note} | {self.validation[name]:.5f} | {self.loss_gap(name):+.2%} | {self.time_cell(name)} |"
            )
        if "fp32" in self.timings:
            lines += ["", self.fp32_step()]
        if self.same_as:
            lines += [
                "",
                "same lists, so any difference between their step times above is this machine's "
                "timing noise: " + ", ".join(f"{a} = {b}" for a, b in self.same_as.items()),
            ]
        lines += ["", self.verdict]
        lines += [
            "",
            f"moved to FP32: {', '.join(self.moved_to_fp32) or 'none'}",
            f"module classes to FP32: {', '.join(self.class_names()) or 'none'}",
            f"added to BF16: {', '.join(self.added_to_bf16) or 'none'}",
        ]
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    def save_html(self, path):
        """One self-contained HTML file (hmp/tools/report/): the audit's errors
        per op and module, the ops tried, the validation and the verdict."""
        write_html(path, tune=self)

    def write(self, bf16_path, fp32_path, promote_path=None):
        """Write list files that hmp.convert() loads, each extending the
        default list (tuned_files.texts: ``include default``, the starting
        lists' own lines and tune's changes, each under a comment saying
        which, module classes as their import paths), or, where the starting
        list replaced the default, replacing it again (every entry a line). All or nothing
        (files.write_all): raises ValueError, writing nothing, when a class
        does not load by its import path, when two paths are the same file,
        or when a path cannot be written."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        summary = (
            f"# written by hmp.tune on {stamp}\n"
            f"# moved to FP32 (flagged by the audit): {', '.join(self.moved_to_fp32) or 'none'}\n"
            f"# module classes to FP32 (a flagged op's error is confined to them): "
            f"{', '.join(self.class_names()) or 'none'}\n"
            f"# added to BF16 (safe and expensive): {', '.join(self.added_to_bf16) or 'none'}\n"
            f"# validation final losses: " + ", ".join(f"{k} {v:.5f}" for k, v in self.validation.items()) + "\n"
        )
        targets = [(kinds.LOWER, bf16_path), (kinds.FP32, fp32_path)]
        targets += [(kinds.PROMOTE, promote_path)] if promote_path else []
        texts = tuned_files.texts(
            self.lists,
            self.modules,
            targets,
            summary,
            self.low,
            self.strict,
            self.before,
            self.start_modules,
            self.start_whole,
        )
        write_all(texts, "hmp.tune")
        self.written = (os.fspath(bf16_path), os.fspath(fp32_path))
