"""How far one run's outputs are from another's: relative errors of paired tensors, paired by op and
module in call order (audit and tune compare an fp32 run with runs under the lists)."""

import torch

TINY = 1e-30


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


def by_op(outputs):
    """name -> innermost module path (None: outside the hooked modules) ->
    the recorded outputs (record.Output), in call order."""
    out = {}
    for o in outputs:
        out.setdefault(o.name, {}).setdefault(o.module, []).append(o.value)
    return out


def pairs(ref, got, name):
    """``[(module path, ref output, got output)]``: the calls of ``name`` in
    two by_op() results, paired by order within each innermost module (so
    calls one run does not record, inside an FP32 module, shift no others)."""
    mine = got.get(name, {})
    return [(m, r, g) for m, values in ref.get(name, {}).items() for r, g in zip(values, mine.get(m, ()))]


def worst(calls):
    """The largest errors over ``calls`` (from pairs()), and their inf/NaN count."""
    max_rel = mean_rel = 0.0
    nonfinite = 0
    for _, ref, got in calls:
        a, b, c = compare(ref, got)
        max_rel, mean_rel, nonfinite = max(max_rel, a), max(mean_rel, b), nonfinite + c
    return max_rel, mean_rel, nonfinite


def worst_by_module(calls):
    """module path -> the largest max relative error of ``calls`` made directly in it."""
    out = {}
    for module, ref, got in calls:
        out[module] = max(out.get(module, 0.0), compare(ref, got)[0])
    return out
