"""hmp.audit: where does bf16 hurt this model?

Runs a step in fp32 and under hmp from the same state and RNG, pairs each
listed op's outputs by call order, and for every op that casts, runs once
more with only that op cast to see the error it alone passes on to the
step's output (the loss). Model state is restored after every run.
"""

import copy
import random
import sys

import torch

from .conversion import applied, current, plan
from .lists import KINDS
from .record import Recorder, snapshot

TINY = 1e-30


class StateGuard:
    """Saves and restores parameters, buffers, gradients, optimizer and
    learning-rate scheduler state, and RNG."""

    def __init__(self, objects):
        self.modules = [o for o in objects if isinstance(o, torch.nn.Module)]
        schedulers = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
        self.optimizers = [o for o in objects if isinstance(o, schedulers)]
        self.saved = self._save()

    def _save(self):
        modules = [{k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()} for m in self.modules]
        grads = [[None if p.grad is None else p.grad.detach().clone() for p in m.parameters()] for m in self.modules]
        optimizers = [copy.deepcopy(o.state_dict()) for o in self.optimizers]
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if "numpy" in sys.modules:
            rng["numpy"] = sys.modules["numpy"].random.get_state()
        return modules, grads, optimizers, rng

    def restore(self):
        modules, grads, optimizers, rng = self.saved
        with torch.no_grad():
            for m, state in zip(self.modules, modules):
                own = m.state_dict(keep_vars=True)
                for k, v in state.items():
                    own[k].copy_(v)
            for m, saved_grads in zip(self.modules, grads):
                for p, g in zip(m.parameters(), saved_grads):
                    p.grad = None if g is None else g.clone()
        for o, state in zip(self.optimizers, optimizers):
            o.load_state_dict(copy.deepcopy(state))
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            sys.modules["numpy"].random.set_state(rng["numpy"])


def _final(value):
    out = snapshot(value)
    if not out and isinstance(value, (int, float)):
        out = (torch.tensor(float(value), dtype=torch.float64),)
    return out


def compare(ref, got):
    """Errors of ``got`` against ``ref`` (tuples of tensors of equal shapes):
    max and mean error relative to the reference's scale, and the number of
    elements that are finite in ``ref`` but not in ``got``."""
    max_rel = mean_rel = 0.0
    nonfinite = 0
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            continue
        r, g = r.double(), g.double()
        both = torch.isfinite(r) & torch.isfinite(g)
        nonfinite += int((torch.isfinite(r) & ~torch.isfinite(g)).sum())
        if both.any():
            diff, scale = (g - r).abs()[both], r.abs()[both]
            max_rel = max(max_rel, float(diff.max() / (scale.max() + TINY)))
            mean_rel = max(mean_rel, float(diff.mean() / (scale.mean() + TINY)))
    return max_rel, mean_rel, nonfinite


class AuditReport:
    def __init__(self, rows, output_error, threshold, loss_threshold):
        self.rows = rows  # one dict per op that ran
        self.output_error = output_error  # relative error of fn's output under full hmp
        self.threshold, self.loss_threshold = threshold, loss_threshold

    @property
    def flagged(self):
        return sorted(r["op"] for r in self.rows if r["flagged"])

    def table(self):
        lines = [
            f"output (loss) relative error under hmp: {self.output_error:.3g}",
            "",
            "| op | list | calls | max rel err | mean rel err | own max rel err | inf/NaN introduced | error passed to loss | flagged |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in sorted(self.rows, key=lambda r: -r["loss_error"]):
            lines.append(
                f"| {r['op']} | {r['list']} | {r['calls']} | {r['max_rel']:.3g} | {r['mean_rel']:.3g} | "
                f"{r['own_max_rel']:.3g} | {r['nonfinite']} | {r['loss_error']:.3g} | {r['reason'] or ''} |"
            )
        return "\n".join(lines)

    def __str__(self):
        return self.table()


def current_or_default():
    """The Conversion in force, or the one a plain ``hmp.convert()`` makes."""
    return current() or plan()


def kind_of(name, lists):
    return next((k for k in KINDS if name in lists[k]), None)


def run_step(fn, args, kwargs, guard, conversion=None, passthrough=False, keep_outputs=False, restore_dtype=False):
    """One run of ``fn`` from the guarded state under ``conversion`` (None:
    plain torch), recorded; the configuration in force is back afterwards."""
    guard.restore()
    recorder = Recorder(keep_outputs=keep_outputs, restore_dtype=restore_dtype)
    with applied(conversion, recorder=recorder, passthrough=passthrough):
        value = fn(*args, **kwargs)
    return _final(value), recorder


def audit(fn, *args, state=(), threshold=0.05, loss_threshold=2e-3, **kwargs):
    """Compare ``fn(*args, **kwargs)`` in fp32 and under hmp, op by op.

    ``state``: modules and optimizers ``fn`` changes (those among ``args``
    are found by themselves); they, their gradients and the RNG are the same
    after the audit as before. An op is flagged when its own bf16 error
    (measured with only it cast) exceeds ``threshold``, when it introduces
    inf/NaN, or when the error it alone passes on to ``fn``'s output exceeds
    ``loss_threshold``. The configuration in force before is restored.
    """
    conversion = current_or_default()
    lists = conversion.lists
    guard = StateGuard(list(state) + list(args) + list(kwargs.values()))
    try:
        ref_final, ref = run_step(fn, args, kwargs, guard, conversion, passthrough=True, keep_outputs=True)
        hmp_final, full = run_step(fn, args, kwargs, guard, conversion, keep_outputs=True)
        output_error = compare(ref_final, hmp_final)[0]
        by_op_ref, by_op_hmp = by_op(ref.outputs), by_op(full.outputs)
        rows = []
        for name, stats in full.stats.items():
            pairs = list(zip(by_op_ref.get(name, []), by_op_hmp.get(name, [])))
            max_rel, mean_rel, nonfinite = worst(pairs)
            row = {"op": name, "list": kind_of(name, lists), "calls": stats.calls, "casts": stats.casts,
                   "max_rel": max_rel, "mean_rel": mean_rel, "nonfinite": nonfinite,
                   "own_max_rel": 0.0, "loss_error": 0.0}
            if stats.casts:
                only = {k: ({name} if name in lists[k] else set()) for k in KINDS}
                own_final, own = run_step(fn, args, kwargs, guard, conversion._replace(lists=only),
                                          keep_outputs=True, restore_dtype=True)
                own_pairs = list(zip(by_op_ref.get(name, []), by_op(own.outputs).get(name, [])))
                row["own_max_rel"], _, own_nonfinite = worst(own_pairs)
                row["nonfinite"] = max(nonfinite, own_nonfinite)
                row["loss_error"], _, final_nonfinite = compare(ref_final, own_final)
                row["nonfinite"] += final_nonfinite
            reasons = []
            if row["own_max_rel"] > threshold:
                reasons.append(f"error {row['own_max_rel']:.2g} > {threshold:g}")
            if row["nonfinite"]:
                reasons.append("introduces inf/NaN")
            if row["loss_error"] > loss_threshold:
                reasons.append(f"loss error {row['loss_error']:.2g} > {loss_threshold:g}")
            row["reason"] = "; ".join(reasons)
            row["flagged"] = bool(reasons)
            rows.append(row)
    finally:
        guard.restore()
    return AuditReport(rows, output_error, threshold, loss_threshold)


def by_op(outputs):
    out = {}
    for name, value in outputs:
        out.setdefault(name, []).append(value)
    return out


def worst(pairs):
    max_rel = mean_rel = 0.0
    nonfinite = 0
    for ref, got in pairs:
        a, b, c = compare(ref, got)
        max_rel, mean_rel, nonfinite = max(max_rel, a), max(mean_rel, b), nonfinite + c
    return max_rel, mean_rel, nonfinite
