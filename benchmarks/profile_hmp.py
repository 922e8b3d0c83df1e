"""Where hmp's time goes: cast accounting, cProfile, a loop for py-spy,
and a per-call cost breakdown.

    python benchmarks/profile_hmp.py casts -w mlp -c hmp-O1 -c autocast
    python benchmarks/profile_hmp.py cprofile -w mlp -c hmp-O1 --steps 300
    python benchmarks/profile_hmp.py loop -w mlp -c hmp-O1 --seconds 20   # under py-spy record
    python benchmarks/profile_hmp.py percall
    python benchmarks/profile_hmp.py lines    # F.linear's added time, line by line of hmp's path

``casts`` logs every aten op one step dispatches (forward, loss, backward,
optimizer) with a TorchDispatchMode, which sits below autocast and below
hmp, so both are seen the same way: dtype casts (aten._to_copy), which of
them copy a parameter, and the dtype each matmul-like op ran in.
"""

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from configs import all_configs, select  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from workloads import all_workloads  # noqa: E402

import hmp  # noqa: E402
from hmp.tools.timing import Stopwatch, per_call  # noqa: E402

COMPUTE = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_addmm_activation",
    "linear",
    "matmul",
    "convolution",
    "_convolution",
    "mkldnn_convolution",
    "_transformer_encoder_layer_fwd",
    "_native_multi_head_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "native_layer_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_softmax",
    "_log_softmax",
    "native_dropout",
    "relu",
    "threshold_backward",
    "gelu",
    "add",
    "mul",
    "cat",
    "clamp_min",
}


def _short(dt):
    return str(dt).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


class OpLog(TorchDispatchMode):
    def __init__(self, params):
        super().__init__()
        self.params = params  # data_ptr -> parameter name
        self.casts = collections.Counter()  # (src, dst, is_param)
        self.param_casts = collections.Counter()  # parameter name -> times cast
        self.ops = collections.Counter()  # (op, dtype of first tensor arg)
        self.n_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.n_ops += 1
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if name == "_to_copy" and first is not None and "dtype" in kwargs and kwargs["dtype"] != first.dtype:
            pname = self.params.get(first.data_ptr()) if first.numel() else None
            self.casts[(_short(first.dtype), _short(kwargs["dtype"]), pname is not None)] += 1
            if pname:
                self.param_casts[pname] += 1
        elif name in COMPUTE and first is not None:
            self.ops[(name, _short(first.dtype))] += 1
        return func(*args, **kwargs)


def _each_config(args, warmup, measure):
    """For each selected configuration: build the workload, run ``warmup``
    steps, then ``measure(w, c, state)``, all under the configuration.
    Yields ``(w, c, what measure returned)``."""
    w = _workload(args.workload)
    for c in _configs(args):
        st = w.build(c, "cpu", args.quick)
        with c.active():
            for _ in range(warmup):
                w.step(st, c, "cpu")
            got = measure(w, c, st)
        yield w, c, got


def cmd_casts(args):
    def measure(w, c, st):
        params = {p.data_ptr(): n for n, p in st.model.named_parameters()}
        log = OpLog(params)
        with log:
            out = w.step(st, c, "cpu")
        return params, log, out

    for w, c, (params, log, out) in _each_config(args, 2, measure):
        n_params = len(params)
        total = sum(log.casts.values())
        print(
            f"\n== {w.name} / {c.name}: output {_short(out.dtype)}; {log.n_ops} aten ops, {total} dtype casts "
            f"({sum(v for k, v in log.casts.items() if k[2])} of parameters; model has {n_params} parameters)"
        )
        for (src, dst, is_param), n in sorted(log.casts.items()):
            print(f"   cast {src:>4} -> {dst:<4} {'param' if is_param else 'activation/other':16s} x{n}")
        repeated = {k: v for k, v in log.param_casts.items() if v > 1}
        if repeated:
            print(f"   parameters cast more than once: {repeated}")
        print(
            "   ops (dtype of first tensor arg): "
            + ", ".join(f"{op}[{dt}] x{n}" for (op, dt), n in sorted(log.ops.items()))
        )


def cmd_trace(args):
    """torch.profiler view of one step: every aten op, nested ones included
    (the inside of fused kernels such as _transformer_encoder_layer_fwd and
    the casts autocast makes there), with its input dtypes."""
    from torch.profiler import ProfilerActivity, profile

    def measure(w, c, st):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = w.step(st, c, "cpu")
        return prof, out

    for w, c, (prof, out) in _each_config(args, 2, measure):
        counts = collections.Counter()
        for e in prof.events():
            if not e.name.startswith("aten::"):
                continue
            dts = [d for d in (e.input_dtypes or []) if d in ("float", "c10::BFloat16", "c10::Half", "double")]
            dts = ",".join(dict.fromkeys(d.replace("c10::BFloat16", "bf16").replace("float", "fp32") for d in dts))
            counts[(e.name[6:], dts)] += 1
        casts = sum(n for (op, _), n in counts.items() if op == "_to_copy")
        print(f"\n== {w.name} / {c.name}: output {_short(out.dtype)}; aten::_to_copy x{casts}")
        shown = [(k, n) for k, n in sorted(counts.items()) if k[0] in COMPUTE or k[0] in ("_to_copy", "linear", "t")]
        print("   " + ", ".join(f"{op}[{dt}] x{n}" for (op, dt), n in shown))


def cmd_cprofile(args):
    def measure(w, c, st):
        prof = cProfile.Profile()
        watch = Stopwatch()
        prof.enable()
        for _ in range(args.steps):
            w.step(st, c, "cpu")
        prof.disable()
        return prof, watch.elapsed

    for w, c, (prof, dt) in _each_config(args, 5, measure):
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"\n== {w.name} / {c.name}: {args.steps} steps, {dt / args.steps * 1e3:.3f} ms/step under cProfile")
        total = sum(v[2] for v in stats.stats.values())  # tottime over all functions
        by_file = collections.defaultdict(float)
        calls = {}
        for (fname, _line, func), (_cc, nc, tt, _ct, _callers) in stats.stats.items():
            key = "hmp/" + Path(fname).name if "/hmp/" in fname else ("torch" if "/torch/" in fname else "other")
            by_file[key] += tt
            if "/hmp/" in fname:
                calls[f"hmp/{Path(fname).name}:{func}"] = (nc / args.steps, tt / args.steps * 1e6)
        print(
            "   self time by origin: "
            + ", ".join(f"{k} {v / total * 100:.1f}%" for k, v in sorted(by_file.items(), key=lambda kv: -kv[1]))
        )
        print("   hmp functions (calls/step, self us/step under cProfile):")
        for k, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
            print(f"     {k:40s} {n:8.1f} {us:10.1f}")
        if args.verbose:
            print(s.getvalue())


def cmd_loop(args):
    w = _workload(args.workload)
    c = _configs(args)[0]
    st = w.build(c, "cpu", args.quick)
    with c.active():
        n, watch = 0, Stopwatch()
        while watch.elapsed < args.seconds:
            w.step(st, c, "cpu")
            n += 1
    print(f"{w.name} / {c.name}: {n} steps, {watch.elapsed / n * 1e3:.3f} ms/step")


def _t(fn, calls=2000, reps=15):
    return statistics.median(per_call(fn, calls) * 1e6 for _ in range(reps))


def cmd_percall(args):
    """Decompose hmp's per-call cost of F.linear / torch.mul / torch.cat on 8x8 tensors."""
    torch.manual_seed(0)
    x, a, b = (torch.randn(8, 8) for _ in range(3))
    w = nn.Parameter(torch.randn(8, 8))
    bias = nn.Parameter(torch.randn(8))
    bf = torch.bfloat16
    xb, ab, bb = x.to(bf), a.to(bf), b.to(bf)
    wb, biasb = w.detach().to(bf), bias.detach().to(bf)
    rows = {}
    rows["F.linear fp32 (plain)"] = _t(lambda: F.linear(x, w, bias))
    rows["F.linear all-bf16 inputs, no casts"] = _t(lambda: F.linear(xb, wb, biasb))
    rows["x.to(bf16) (activation cast)"] = _t(lambda: x.to(bf))
    rows["w.to(bf16) (parameter cast, records ToCopyBackward)"] = _t(lambda: w.to(bf))
    rows["F.linear(x->bf16, cached w/b bf16)  ~ autocast's work"] = _t(lambda: F.linear(x.to(bf), wb, biasb))
    rows["F.linear(x, w, b all cast each call)  ~ hmp's work"] = _t(lambda: F.linear(x.to(bf), w.to(bf), bias.to(bf)))
    with torch.autocast("cpu", dtype=bf):
        rows["autocast F.linear (one region)"] = _t(lambda: F.linear(x, w, bias))
    with hmp.converted():
        rows["hmp O1 F.linear"] = _t(lambda: F.linear(x, w, bias))
        with hmp.disable_casts():
            rows["hmp O1 F.linear inside disable_casts (wrapper pass-through)"] = _t(lambda: F.linear(x, w, bias))
        rows["hmp O1 torch.mul (bf16 list: 2 casts)"] = _t(lambda: torch.mul(a, b))
        rows["hmp O1 torch.cat (promote list, no cast)"] = _t(lambda: torch.cat([a, b]))
    rows["torch.mul fp32 (plain)"] = _t(lambda: torch.mul(a, b))
    rows["torch.mul bf16 inputs"] = _t(lambda: torch.mul(ab, bb))
    rows["torch.mul(a->bf16, b->bf16)"] = _t(lambda: torch.mul(a.to(bf), b.to(bf)))
    rows["torch.cat fp32 (plain)"] = _t(lambda: torch.cat([a, b]))

    def py_wrapper(*args, **kwargs):  # the floor of any Python-level wrapper
        return torch.cat(*args, **kwargs)

    rows["torch.cat via a bare Python wrapper"] = _t(lambda: py_wrapper([a, b]))
    for k, v in rows.items():
        print(f"{v:8.2f} us  {k}")


def _ns(stmt, env, number=20000, reps=21):
    """Median ns of ``stmt`` minus an empty statement, interleaved."""
    base, cost = [], []
    for _ in range(reps):
        base.append(timeit.timeit("pass", globals=env, number=number))
        cost.append(timeit.timeit(stmt, globals=env, number=number))
    return (statistics.median(cost) - statistics.median(base)) / number * 1e9


def cmd_lines(args):
    """Where the time hmp adds to one ``F.linear(x, w, b)`` goes (8x8, one
    thread): each line of the wrapper and of a weight-cache hit timed on its
    own, against hmp's whole call and autocast's added time."""
    from hmp.core import cache, state

    torch.manual_seed(0)
    x = torch.randn(8, 8)
    w, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    bf = torch.bfloat16
    linear = F.linear

    def passthrough(*args, **kwargs):
        return linear(*args, **kwargs)

    with hmp.converted():
        caster = hmp.core.cache.caster(bf).any
        keep = caster(w)  # a live copy: the next casts of w are hits
        env = dict(
            torch=torch,
            x=x,
            w=w,
            b=b,
            bf=bf,
            linear=linear,
            passthrough=passthrough,
            F=F,
            hmp=hmp,
            st=state.tls,
            cast=caster,
            plain=torch.Tensor.bfloat16,
            live=state.weight_cache.grad_mode[bf],
            cache=cache,
            Tensor=torch.Tensor,
            FP32=torch.float32,
            P=nn.Parameter,
        )
        e = env["live"][id(w)]
        env["e"] = e
        rows = [
            (
                "wrapper: a Python function between caller and op (*args, **kwargs)",
                _ns("passthrough(x, w, b)", env) - _ns("linear(x, w, b)", env),
            ),
            ("wrapper: read the thread's state (st.off)", _ns("st.off", env)),
            ("wrapper: set and reset it around the op", _ns("st.off = 1; st.off = 0", env)),
            (
                "rule: isinstance + dtype check, per tensor argument (x3)",
                3 * _ns("isinstance(x, Tensor) and x.dtype is FP32", env),
            ),
            ("rule: the activation cast x.bfloat16() (autocast casts in C++)", _ns("plain(x)", env)),
            ("cache hit, whole (per weight: x and w in training)", _ns("cast(w)", env)),
            ("cache miss: a weight no graph keeps a copy of (the bias), cast again", _ns("cast(b)", env, number=2000)),
            ("  of which the cast itself, b.bfloat16() with autograd", _ns("plain(b)", env, number=2000)),
            ("  hit: type(w) is Parameter", _ns("type(w) is P", env)),
            ("  hit: torch.compiler.is_compiling()", _ns("cache._is_compiling()", env)),
            ("  hit: jit tracing state", _ns("cache._tracing_state()", env)),
            ("  hit: torch.is_grad_enabled()", _ns("cache._grad_enabled()", env)),
            ("  hit: live.get(id(w))", _ns("live.get(id(w))", env)),
            ("  hit: the weak reference to the copy", _ns("e.copy()", env)),
            ("  hit: version counter compared", _ns("e.version == cache._version(w)", env)),
            ("  hit: data pointer compared", _ns("e.ptr == w.data_ptr()", env)),
            ("  hit: requires_grad compared", _ns("e.grad is w.requires_grad", env)),
        ]
        del keep
        # the whole call, each weight's copy kept alive by a live graph as in training
        h = torch.randn(8, 8, requires_grad=True)
        out = F.linear(h, w, b)
        env.update(h=h)
        whole = _ns("F.linear(h, w, b)", env, number=2000)
        del out
    bare = _ns("linear(h, w, b)", env, number=2000)
    hb, wb, bb = (t.detach().bfloat16().requires_grad_() for t in (h, w, b))
    env.update(hb=hb, wb=wb, bb=bb)
    kernel = _ns("linear(hb, wb, bb)", env, number=2000)
    with torch.autocast("cpu", dtype=bf):
        auto = _ns("linear(h, w, b)", env, number=2000)
    for label, ns in rows:
        print(f"{ns:8.0f} ns  {label}")
    print(f"{kernel - bare:8.0f} ns  the bf16 kernel (with autograd) over the fp32 one")
    print(f"{whole - bare:8.0f} ns  hmp's F.linear(h, w, b) in training, added over bare torch")
    print(f"{auto - bare:8.0f} ns  autocast's, in one region")


def _workload(name):
    by = {w.name: w for w in all_workloads()}
    if name not in by:
        raise SystemExit(f"unknown workload {name}; choose from {list(by)}")
    return by[name]


def _configs(args):
    return select(all_configs("cpu"), args.config or ["hmp-O1"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["casts", "trace", "cprofile", "loop", "percall", "lines"])
    ap.add_argument("-w", "--workload", default="mlp")
    ap.add_argument("-c", "--config", action="append")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    {
        "casts": cmd_casts,
        "trace": cmd_trace,
        "cprofile": cmd_cprofile,
        "loop": cmd_loop,
        "percall": cmd_percall,
        "lines": cmd_lines,
    }[args.cmd](args)


# its quickest run that still goes through its code (tests/integration/test_benchmark_scripts.py)
QUICK = ("casts", "--quick")


if __name__ == "__main__":
    main()
