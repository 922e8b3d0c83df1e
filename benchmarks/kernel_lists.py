"""Write the hmp list files of the ops that have no lower-precision kernel, or need one dtype.

    python benchmarks/kernel_lists.py            # (re)write the files from the installed torch alone
    python benchmarks/kernel_lists.py --merge    # add the installed torch's ops, keep the names there
    python benchmarks/kernel_lists.py --check    # exit 1 if the installed torch finds an op the files lack
    python benchmarks/kernel_lists.py --verbose  # also print every error seen, counted or not

The files (in op_lists/):

* ``no_kernel_bf16.txt``, ``no_kernel_fp16.txt``: ops that raise when their floating tensors are
  bfloat16 (float16) where they run in float32. hmp gives such an op, when it is in none of the
  user's lists, the FP32 rule (bfloat16/float16 tensor arguments cast to float32).
* ``one_dtype.txt``: ops that run with all their floating tensors in bfloat16 (or float16) and
  in float32, but raise when given a mix of the two. hmp gives such an op the promote rule (all
  floating tensor arguments to the widest floating dtype among them).

Sources, for the installed torch:

* torch's OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``: torch,
  Tensor methods, nn.functional, linalg, fft, special, ...; it needs ``expecttest``). Each OpInfo
  whose CPU dtypes include float32 is called with its float32 CPU sample inputs (the first
  ``SAMPLES_PER_OP`` that run; all of them for almost every OpInfo), through
  its public Python name (``torch.linalg.cholesky``, ``torch.nn.functional.grid_sample``,
  ``torch.Tensor.X`` for a method; an OpInfo whose ``op`` is its own wrapper lambda is called
  through that lambda, which reaches torch through the public names at call time). A sample that
  fails in float32 is skipped. Then, for L = bfloat16 and float16: every floating tensor of the
  sample (input, args, kwargs, at any depth) converted to L ("all"); only the first one converted
  ("first"); every one but the first converted ("rest"). "all" raising a dtype error puts the op
  in the no-kernel list for L; "first" or "rest" raising a dtype error while "all" ran puts it in
  the one-dtype list. Only errors about dtypes count (``dtype_error``); the others are printed as
  excluded.
* OpInfo's declared CUDA dtypes (no GPU needed): an op whose CUDA dtypes include float32 but not
  L goes into the no-kernel list for L too, so that hmp does not crash on a GPU either. They are
  read in a subprocess that imports op_db as on a current GPU (``common_cuda.SM*OrLater`` taken
  true): without a GPU those flags are false and GEMMs (matmul, bmm, addmm...) would declare no
  bfloat16.

A failing OpInfo is listed under the first of its ``aten_name``, its name with dots replaced
(``fft.rfft`` -> ``fft_rfft``) and its name's last component (``nn.functional.grid_sample`` ->
``grid_sample``) that ``hmp.binding.resolve.Resolver().check`` reports BOUND and that binds the function
the sweep called; one with no such name (``torch.sparse.mm``, ``torch.masked.*``), or whose name
hmp refuses in a list (``view_as_complex`` returns a view), is named in the file's header as left
out.

The files must hold on every torch release hmp supports: generate with one release, then run
``--merge`` under each other one; each file's header records the releases merged. ``--check``
passes when every op this torch's sweep finds is in the files.
"""

import argparse
import contextlib
import json
import re
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling script, also when imported by path
from autocast_lists import wrap_comment  # noqa: E402

from hmp.binding import kinds  # noqa: E402
from hmp.binding import lists as hmp_lists  # noqa: E402
from hmp.binding.aten import returns_view  # noqa: E402
from hmp.binding.resolve import BOUND, Resolver  # noqa: E402
from hmp.core.identity import unwrap  # noqa: E402
from hmp.tools.timing import Stopwatch  # noqa: E402

LIST_DIR = ROOT / "op_lists"
LOWER = {"bf16": torch.bfloat16, "fp16": torch.float16}
FILES = {"no_kernel_bf16": "no_kernel_bf16.txt", "no_kernel_fp16": "no_kernel_fp16.txt", "one_dtype": "one_dtype.txt"}
SAMPLES_PER_OP = 50  # float32 samples that ran, per OpInfo (most have fewer): the sweep takes about 30 s
VARIANTS = ("all", "first", "rest")
COMMAND = "python benchmarks/kernel_lists.py --merge"

# -- what counts as an error about dtypes ------------------------------------------------------

# An error counts when it is one of these types and its message says something about dtypes. The
# others (a matrix that bfloat16 rounding made singular or not positive-definite, a shape error)
# are printed as excluded: casting cannot fix them.
DTYPE_ERROR_TYPES = (RuntimeError, TypeError, NotImplementedError, ValueError)
DTYPE_WORDS = re.compile(
    r"dtype|scalar ?type|not implemented for|BFloat16|bfloat16|\bHalf\b|float16|same type|"
    r"type \(.*\) (?:and|should)|Float|Double|precision",
    re.I,
)
NOT_DTYPE = re.compile(r"positive.definite|singular|failed to converge|ill.conditioned", re.I)


def dtype_error(exc):
    """True when ``exc`` is an error about its inputs' dtypes (no kernel for one, or a mix)."""
    if not isinstance(exc, DTYPE_ERROR_TYPES):
        return False
    msg = str(exc)
    return bool(DTYPE_WORDS.search(msg)) and not NOT_DTYPE.search(msg)


def first_line(exc):
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


# -- the OpInfo database ----------------------------------------------------------------------


def load_op_db():
    """torch's OpInfo list (importing it raises ImportError without ``expecttest``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def op_key(op):
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def cpu_dtypes(op):
    return op.supported_dtypes("cpu")


def public_call(op):
    """``(label, fn)``: a callable that reaches ``op`` through torch's public Python names,
    looked up at each call (so while hmp is converted it calls hmp's wrapper), or None.

    An OpInfo whose ``op`` is a lambda of torch's test suite (``einsum``, ``where``,
    ``nn.functional.dropout``...) is called through it: the lambda only reorders arguments and
    calls ``torch.X`` at call time. Any other ``op`` (a builtin captured when op_db was built)
    would bypass hmp, so its name is resolved instead: ``torch.<name>`` (``torch.fft.rfft``,
    ``torch.nn.functional.grid_sample``), else ``torch.Tensor.<name>`` for a method."""
    fn = op.op
    if isinstance(fn, types.FunctionType) and (fn.__module__ or "").startswith("torch.testing."):
        return f"{op.name} (OpInfo lambda)", fn
    path = op.name[len("torch.") :] if op.name.startswith("torch.") else op.name
    if path.startswith("ops."):
        return None  # torch.ops.aten overloads: not a Python name hmp wraps
    parts = path.split(".")
    for root, label in ((torch, "torch."), (torch.Tensor, "torch.Tensor.")):
        if root is torch.Tensor and len(parts) > 1:
            break
        if _lookup(root, parts) is not None:
            return label + path, _late_call(root, parts)
    return None


def _lookup(root, parts):
    obj = root
    for p in parts:
        obj = getattr(obj, p, None)
        if obj is None:
            return None
    return obj if callable(obj) and not isinstance(obj, (type, types.ModuleType)) else None


def _late_call(root, parts):
    """A function that calls ``root.<parts>`` as it is at call time; ``.target()`` returns it."""

    def target():
        return _lookup(root, parts)

    def call(*args, **kwargs):
        return target()(*args, **kwargs)

    call.target = target
    return call


def _map_tensors(obj, fn):
    """``obj`` with every tensor ``t`` in it (in lists, tuples, dicts, at any depth) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


@dataclass
class Probe:
    """One float32 sample of one OpInfo that ran in float32."""

    op: object
    label: str
    call: object
    args: tuple  # (input, *args) of the sample, float32
    kwargs: dict
    n_floating: int  # floating tensors in it

    @property
    def key(self):
        return op_key(self.op)

    def variant(self, low, which):
        """``(args, kwargs)``: fresh copies of the sample's tensors, the floating ones
        chosen by ``which`` ("fp32": none, "all", "first", "rest") converted to ``low``."""
        index = [0]

        def convert(t):
            if not t.is_floating_point():
                return t.clone()
            i = index[0]
            index[0] += 1
            lowered = which == "all" or (which == "first" and i == 0) or (which == "rest" and i > 0)
            return t.to(low) if lowered else t.clone()

        return _map_tensors((self.args, self.kwargs), convert)

    def run(self, low, which):
        """The exception calling the op with ``variant(low, which)`` raised, or None."""
        args, kwargs = self.variant(low, which)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure is reported, classified by the caller
            return e
        return None

    def variants(self):
        """The lower-precision variants this sample has: a mix needs two floating tensors."""
        return VARIANTS if self.n_floating >= 2 else VARIANTS[:1] if self.n_floating else ()


def _count_floating(obj):
    n = [0]

    def count(t):
        n[0] += t.is_floating_point()
        return t

    _map_tensors(obj, count)
    return n[0]


@dataclass
class Sweep:
    probes: list = field(default_factory=list)
    ops: dict = field(default_factory=dict)  # key -> OpInfo, every OpInfo probed
    not_probed: dict = field(default_factory=dict)  # key -> why
    seconds: float = 0.0


@contextlib.contextmanager
def no_test_lookup():
    """OpInfo's sample iterators look for the unittest.TestCase they run for (``extract_test_fn``:
    inspect.stack(), and for each frame a scan of every module loaded). The sweep runs in none, so
    the answer is None; under pytest, with the integration libraries loaded, the scans were most of a
    collection (105 s of a CI leg's setup for 3 s of samples). Within this block the lookup answers
    None at once (in each torch module that holds it; restored after)."""
    import torch.testing._internal.common_utils as common_utils
    import torch.testing._internal.opinfo.core as opinfo_core

    holders = [m for m in (common_utils, opinfo_core) if hasattr(m, "extract_test_fn")]
    before = [m.extract_test_fn for m in holders]
    for m in holders:
        m.extract_test_fn = lambda: None
    try:
        yield
    finally:
        for m, fn in zip(holders, before):
            m.extract_test_fn = fn


def collect_probes(op_db=None, cap=SAMPLES_PER_OP, only=None):
    """The float32 samples of every OpInfo with float32 on CPU that ran in float32 (with hmp
    not converted), at most ``cap`` per OpInfo. ``only``: OpInfo keys to restrict to."""
    with no_test_lookup():
        return _collect_probes(op_db, cap, only)


def _collect_probes(op_db, cap, only):
    op_db = load_op_db() if op_db is None else op_db
    sweep = Sweep()
    watch = Stopwatch()
    for op in op_db:
        key = op_key(op)
        if only is not None and key not in only:
            continue
        if torch.float32 not in cpu_dtypes(op):
            continue
        found = public_call(op)
        if found is None:
            sweep.not_probed[key] = "no public Python name reaches it"
            continue
        label, call = found
        torch.manual_seed(0)
        kept, tried, fp32_error = [], 0, None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                samples = iter(op.sample_inputs("cpu", torch.float32))
                while len(kept) < cap and tried < 2 * cap:
                    s = next(samples, None)
                    if s is None:
                        break
                    tried += 1
                    probe = Probe(
                        op,
                        label,
                        call,
                        (s.input, *s.args),
                        dict(s.kwargs),
                        _count_floating((s.input, s.args, s.kwargs)),
                    )
                    error = probe.run(torch.float32, "fp32")
                    if error is None:
                        kept.append(probe)
                    else:
                        fp32_error = error
        except Exception as e:  # noqa: BLE001 - a sample generator that breaks on this torch
            sweep.not_probed[key] = f"its sample inputs fail: {first_line(e)}"
            continue
        if not kept:
            sweep.not_probed[key] = (
                f"no sample ran in float32 ({first_line(fp32_error)})" if fp32_error else "no sample inputs"
            )
            continue
        sweep.ops[key] = op
        sweep.probes += kept
    sweep.seconds = watch.elapsed
    return sweep


@dataclass
class Finding:
    key: str  # OpInfo key
    low: str  # "bf16" or "fp16"
    variant: str
    error: str  # first line
    counted: bool  # a dtype error


def probe_errors(probes, lows=("bf16", "fp16")):
    """``[Finding]``: every lower-precision variant of every probe that raised."""
    out = []
    for probe in probes:
        for low in lows:
            for which in probe.variants():
                e = probe.run(LOWER[low], which)
                if e is not None:
                    out.append(Finding(probe.key, low, which, first_line(e), dtype_error(e)))
    return out


def classify(findings):
    """``({"bf16": keys, "fp16": keys}, one-dtype keys)`` from the counted findings: no kernel
    for L when "all" raised; one dtype when a mix raised and "all" never did for that L."""
    no_kernel = {low: set() for low in LOWER}
    mixed = {low: set() for low in LOWER}
    for f in findings:
        if f.counted:
            (no_kernel if f.variant == "all" else mixed)[f.low].add(f.key)
    one = set()
    for low in LOWER:
        one |= mixed[low] - no_kernel[low]
    return no_kernel, one


# -- declared CUDA dtypes ---------------------------------------------------------------------

_CUDA_DTYPES = r"""
import json, re, sys, warnings
import torch
import torch.testing._internal.common_cuda as cc
for name in dir(cc):  # dtypes OpInfo declares on a current GPU, not on this GPU-less machine
    if re.fullmatch(r"SM\d+OrLater", name):
        setattr(cc, name, True)
warnings.simplefilter("ignore")
from torch.testing._internal.common_methods_invocations import op_db
out = {}
for op in op_db:
    key = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
    try:
        dts = op.supported_dtypes("cuda")
    except Exception:
        dts = getattr(op, "dtypesIfCUDA", None) or ()
    out[key] = sorted(str(d) for d in dts)
print("\n" + MARK + json.dumps(out))
"""


def cuda_declared():
    """``{OpInfo key: [dtype names]}``: the CUDA dtypes each OpInfo declares, as on a current GPU."""
    mark = "OPINFO-CUDA-DTYPES:"  # torch's test modules may print to stdout while importing
    p = subprocess.run(
        [sys.executable, "-c", f"MARK = {mark!r}\n" + _CUDA_DTYPES], capture_output=True, text=True, timeout=600
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith(mark)]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"reading OpInfo's CUDA dtypes failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len(mark) :])


def cuda_no_kernel(sweep, declared):
    """``{"bf16": keys, "fp16": keys}``: probed OpInfos (with a floating tensor input) whose
    declared CUDA dtypes include float32 but not L."""
    out = {low: set() for low in LOWER}
    floating = {p.key for p in sweep.probes if p.n_floating}
    for key in floating:
        dts = set(declared.get(key, ()))
        if "torch.float32" not in dts:
            continue
        for low, dtype in LOWER.items():
            if str(dtype) not in dts:
                out[low].add(key)
    return out


# -- OpInfo -> list name ----------------------------------------------------------------------


def candidates(op):
    names = [op.aten_name, op.name.replace(".", "_"), op.name.split(".")[-1]]
    if op.name.startswith("torch."):
        names.insert(1, op.name[len("torch.") :].replace(".", "_"))
    return list(dict.fromkeys(n for n in names if n))


def list_name(op, resolver):
    """The name the list files use for ``op``, or None: the first candidate that
    ``Resolver().check`` reports BOUND and that binds the very function the sweep calls
    (``torch.sparse.mm`` is no site of ``mm``); for an OpInfo called through its lambda
    (whose callee is not known here), the first BOUND candidate. None too when hmp refuses
    that name in a list (``view_as_complex`` returns a view of its input: hmp never casts it)."""
    target = public_target(op)
    for name in candidates(op):
        try:
            resolved, status, _ = resolver.check(name, hint=False)
        except Exception:  # noqa: BLE001 - a name the resolver cannot parse is no candidate
            continue
        if status != BOUND:
            continue
        if target is not None and not any(_same(site.original(), target) for site in resolver.sites(resolved)):
            continue
        return None if refusal(resolved) else resolved  # hmp refuses a view op's name in a list
    return None


def refusal(name):
    """Why hmp refuses ``name`` in a list file (it returns a view of its input...), or None."""
    refuse = getattr(hmp_lists, "refusal", None)
    if refuse is not None:
        return refuse(name)
    return "returns a view of its input" if returns_view(name) else None


def public_target(op):
    """The function ``public_call`` reaches for ``op`` (hmp not converted), or None for a lambda."""
    found = public_call(op)
    if found is None or found[1] is op.op:
        return None
    return unwrap(found[1].target())


def _same(a, b):
    return a is b or (getattr(a, "__func__", a) is getattr(b, "__func__", b))


def to_names(keys, ops, resolver):
    """``(list names, dropped OpInfo keys)``."""
    names, dropped = set(), set()
    for key in keys:
        name = list_name(ops[key], resolver)
        (names.add(name) if name else dropped.add(key))
    return names, dropped


# -- the files --------------------------------------------------------------------------------

WHAT = {
    "no_kernel_bf16": [
        "Ops with no bfloat16 kernel: they raise when their floating tensors are bfloat16 where",
        "float32 runs. An op here that is in none of the user's lists gets hmp's FP32 rule",
        "(bfloat16/float16 tensor arguments cast to float32), so a bfloat16 tensor from a",
        "listed op reaching it does not crash.",
    ],
    "no_kernel_fp16": [
        "Ops with no float16 kernel: they raise when their floating tensors are float16 where",
        "float32 runs. An op here that is in none of the user's lists gets hmp's FP32 rule",
        "(bfloat16/float16 tensor arguments cast to float32), so a float16 tensor from a",
        "listed op reaching it does not crash.",
    ],
    "one_dtype": [
        "Ops that need all their floating inputs in one dtype: they run with all of them in",
        "bfloat16 (or float16) and in float32, but raise given a mix. An op here that is in none",
        "of the user's lists gets hmp's promote rule (all floating tensor arguments to the",
        "widest floating dtype among them, as torch.result_type gives).",
    ],
}
SOURCE = [
    "Source: torch's OpInfo database (float32 CPU samples called with their floating tensors",
    "lowered, and OpInfo's declared CUDA dtypes), swept by benchmarks/kernel_lists.py.",
]
RELEASES = "# Torch releases merged: "
DROPPED = "# Left out, hmp cannot wrap them: OpInfos no name hmp binds reaches, or whose name hmp refuses in a list:"
NOT_IN = "not in torch "  # a name's annotation: merged releases that lack the op
ANNOTATED = [
    "The union over releases names ops some releases lack: each such name says which merged",
    "releases lack it (# not in torch ...); hmp skips a name the installed torch does not have.",
]


@dataclass
class ListFile:
    names: dict  # name -> set of merged releases that lack it
    releases: list
    dropped: set  # OpInfo keys


def parse(text):
    """The ``ListFile`` of a list file written by ``render``."""
    out, in_dropped = ListFile({}, [], set()), False
    for line in text.splitlines():
        if line.startswith(RELEASES):
            out.releases = [r.strip() for r in line[len(RELEASES) :].rstrip(".").split(",") if r.strip()]
        elif line.startswith(DROPPED):
            in_dropped = True
            continue
        elif in_dropped and line.startswith("#   "):
            out.dropped.update(line[1:].split())
            continue
        elif not line.startswith("#"):
            name, _, comment = (part.strip() for part in line.partition("#"))
            if name:
                lacking = comment[len(NOT_IN) :] if comment.startswith(NOT_IN) else ""
                out.names[name] = {r.strip() for r in lacking.split(",") if r.strip()}
        in_dropped = False
    return out


def read(kind):
    """The ``ListFile`` of the shipped file of ``kind`` (a key of FILES)."""
    return parse((LIST_DIR / FILES[kind]).read_text(encoding="utf-8"))


def render(kind, listed):
    lines = ["# " + s for s in WHAT[kind] + SOURCE]
    lines.append(RELEASES + ", ".join(listed.releases) + ".")
    lines.append(f"# Command, once under each release (a plain run rewrites from one release): {COMMAND}")
    if any(listed.names.values()):
        lines += ["# " + s for s in ANNOTATED]
    if listed.dropped:
        lines.append(DROPPED)
        lines += wrap_comment(sorted(listed.dropped), 100)
    for name in sorted(listed.names):
        lacking = sorted(listed.names[name], key=_release_key)
        lines.append(f"{name}  # {NOT_IN}{', '.join(lacking)}" if lacking else name)
    return "\n".join(lines) + "\n"


def bound_here(name, resolver):
    return resolver.check(name, hint=False)[1] == BOUND


def release():
    return torch.__version__.split("+")[0]


def _release_key(r):
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.]", r))


# -- the sweep and the report -----------------------------------------------------------------


def run_sweep(cap=SAMPLES_PER_OP, verbose=False, log=print):
    """``{kind: (names, dropped)}`` for this torch, printing what was excluded."""
    with one_thread():
        sweep = collect_probes(cap=cap)
        watch = Stopwatch()
        findings = probe_errors(sweep.probes)
    log(
        f"torch {torch.__version__}: {len(sweep.ops)} OpInfos probed with {len(sweep.probes)} float32 samples "
        f"({sweep.seconds:.0f} s), lower-precision calls {watch.elapsed:.0f} s; "
        f"{len(sweep.not_probed)} not probed"
    )
    for key, why in sorted(sweep.not_probed.items()):
        log(f"  not probed: {key}: {why}")
    excluded = sorted({(f.key, f.low, f.variant, f.error) for f in findings if not f.counted})
    log(f"excluded as not about dtypes ({len(excluded)}):")
    for row in excluded:
        log("  " + " | ".join(row))
    if verbose:
        log("counted:")
        for row in sorted({(f.key, f.low, f.variant, f.error) for f in findings if f.counted}):
            log("  " + " | ".join(row))
    no_kernel, one = classify(findings)
    declared = cuda_declared()
    cuda = cuda_no_kernel(sweep, declared)
    for low in LOWER:
        extra = sorted(cuda[low] - no_kernel[low])
        log(
            f"no {low} kernel: {len(no_kernel[low])} OpInfos on CPU, {len(extra)} more from declared CUDA dtypes: "
            f"{', '.join(extra)}"
        )
        no_kernel[low] |= cuda[low]
    one -= no_kernel["bf16"] & no_kernel["fp16"]  # the FP32 rule covers a mix of either
    resolver = Resolver()
    out = {f"no_kernel_{low}": to_names(no_kernel[low], sweep.ops, resolver) for low in LOWER}
    out["one_dtype"] = to_names(one, sweep.ops, resolver)
    with one_thread():
        composites = run_as_composites(sweep, findings, out, resolver)
    for kind, keys in composites.items():
        names, dropped = out[kind]
        gone = {list_name(sweep.ops[k], resolver) for k in keys}
        log(f"{kind}: runs under hmp once the ops it calls are cast (not listed): {', '.join(sorted(gone)) or '-'}")
        out[kind] = (names - gone, dropped)
    for kind, (names, dropped) in out.items():
        log(f"{kind}: {len(names)} names" + (f"; left out: {', '.join(sorted(dropped))}" if dropped else ""))
    return out


def run_as_composites(sweep, findings, out, resolver):
    """``{kind: OpInfo keys}`` to leave out of the files: ops that are Python functions and
    that raise in plain torch, but run under ``hmp.converted()`` with the op itself in no list
    and every other op of the files in force: the ops they call are cast by their own lists or
    the files (``F.multi_head_attention_forward`` given a bfloat16 query calls ``linear``,
    which the BF16 list casts). Listing such an op would run all of it in float32 instead."""
    from hmp.binding.resolve import BUILTINS

    failing = {}
    for f in findings:
        if f.counted:
            failing.setdefault(f.key, set()).add((f.low, f.variant))
    by_key = {}
    for probe in sweep.probes:
        by_key.setdefault(probe.key, []).append(probe)
    drop = {}
    for kind, (names, _) in out.items():
        for key in sorted(set(failing) & set(sweep.ops)):
            name = list_name(sweep.ops[key], resolver)
            if name not in names or all(isinstance(s.original(), BUILTINS) for s in resolver.sites(name)):
                continue
            if not any(
                _raises_under_hmp(by_key[key], low, which, name, out)
                for low, which in failing[key]
                if kind == "one_dtype" or kind.endswith(low)
            ):
                drop.setdefault(kind, set()).add(key)
    return drop


def _raises_under_hmp(probes, low, which, name, out):
    import tempfile

    import hmp

    others = {kind: tuple(n for n in names if n != name) for kind, (names, _) in out.items()}
    with tempfile.TemporaryDirectory() as d:
        files = {}
        for kind in ("bf16", "fp32", "promote"):
            path = Path(d) / f"{kind}.txt"
            path.write_text(f"include default\n-{name}\n")
            files[f"{kind}_file_path"] = path
        saved = hmp_lists.fallback_names
        hmp_lists.fallback_names = lambda lower: (
            (kinds.FP32, others[f"no_kernel_{'bf16' if lower == torch.bfloat16 else 'fp16'}"]),
            (kinds.PROMOTE, others["one_dtype"]),
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with hmp.converted(low_precision_type=LOWER[low], **files):
                    return any(dtype_error(e) for e in (p.run(LOWER[low], which) for p in probes) if e is not None)
        finally:
            hmp_lists.fallback_names = saved


@contextlib.contextmanager
def one_thread():
    """Small tensors: intra-op threads only contend (the machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if an op this torch's sweep finds is missing from the files"
    )
    mode.add_argument(
        "--merge", action="store_true", help="keep the names (and releases) already in the files and add this torch's"
    )
    ap.add_argument("--samples", type=int, default=SAMPLES_PER_OP, help="float32 samples per OpInfo")
    ap.add_argument("--verbose", action="store_true", help="also print every counted error")
    args = ap.parse_args(argv)
    found = run_sweep(cap=args.samples, verbose=args.verbose)
    resolver = Resolver()
    here = release()
    problems, written = [], []
    for kind, (names, dropped) in found.items():
        path = LIST_DIR / FILES[kind]
        old = parse(path.read_text(encoding="utf-8")) if path.exists() else ListFile({}, [], set())
        if args.check:
            missing = sorted(names - set(old.names)) + sorted(dropped - old.dropped)
            if missing:
                problems.append(f"{path.name}: missing for torch {here}: {', '.join(missing)}")
            stale = sorted(n for n, lacking in old.names.items() if not bound_here(n, resolver) and here not in lacking)
            if stale:
                problems.append(f"{path.name}: not bound by hmp on torch {here} and not marked so: {', '.join(stale)}")
            continue
        listed = ListFile({n: set() for n in names}, [here], set(dropped))
        if args.merge:
            for name, lacking in old.names.items():
                listed.names.setdefault(name, set()).update(lacking)
            for name, lacking in listed.names.items():
                (lacking.discard if bound_here(name, resolver) else lacking.add)(here)
            listed.dropped |= old.dropped
            listed.releases = sorted(set(old.releases) | {here}, key=_release_key)
        text = render(kind, listed)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path.name)
    if args.check:
        print("\n".join(problems) if problems else f"kernel list files hold every op torch {here} finds")
        return 1 if problems else 0
    print("wrote: " + (", ".join(written) if written else "nothing (up to date)"))
    if args.merge and written:
        print(
            "names added here are marked for the releases that lack them only by a --merge under those "
            "releases: run --merge under each release until it writes nothing"
        )
    return 0


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("--check",)


if __name__ == "__main__":
    sys.exit(main())
