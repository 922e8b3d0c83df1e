"""How torch.compile traces a C wrapper installed as ``F.linear`` (issue 33).

    python benchmarks/cbody/compile_probe.py

1. hmp's Python wrapper: dynamo inlines it (one graph, bf16 out).
2. The C wrapper as it is: dynamo sees an object of an unknown C type whose
   ``__call__`` is a slot wrapper, which it cannot inline: a graph break.
3. The C wrapper with ``torch.compiler.substitute_in_graph`` registered once
   for the *type's* ``Wrapper.__call__`` (a ``wrapper_descriptor``, which it
   accepts): dynamo inlines the Python polyfill, which is hmp's own
   ``wrap._body`` built from the wrapper's fields, so no second copy of the
   body exists. One graph again.
"""

import os
import sys

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import hmp
from hmp.core import wrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (sets the C modules up)
from _cbody import Wrapper  # noqa: E402


def traced_call(self, *args, **kwargs):
    """What dynamo inlines for a call of a C Wrapper: hmp's Python body, from the wrapper's fields."""
    body = wrap._body(
        self.op,
        self.prepare,
        self.wrapped,
        self.src,
        self.cast,
        self.refuse,
        self.inplace_at,
        bool(self.hidden),
        self.needs,
    )
    return body(*args, **kwargs)


def probe(label, impl, x, w, b):
    F.linear = impl

    def fn(t):
        return torch.relu(F.linear(t, w, b))

    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(x)
    reasons = sorted({str(r.reason).splitlines()[0][:150] for r in ex.break_reasons})
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend="eager", fullgraph=True)(x)
        full = f"fullgraph ok, {out.dtype}"
    except Exception as e:  # torch._dynamo.exc.Unsupported
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        full = f"fullgraph fails: {type(e).__name__}: {' / '.join(lines[:2])}"
        out = torch.compile(fn, backend="eager")(x)
    torch._dynamo.reset()
    eager = fn(x)
    print(
        f"{label}: graphs {ex.graph_count}, breaks {ex.graph_break_count}; {full}; out {out.dtype}, "
        f"equal to eager {torch.equal(out, eager)}"
    )
    for r in reasons:
        print(f"    break: {r}")
    return out


def main():
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    w, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    hmp.convert()
    pyw = F.linear
    try:
        ref = probe("1. Python wrapper", pyw, x, w, b)
        cw = bench.c_wrapper(pyw)
        probe("2. C wrapper", cw, x, w, b)
        print(f"   Wrapper.__call__ is a {type(Wrapper.__call__).__name__}; substitute_in_graph takes it")
        torch.compiler.substitute_in_graph(Wrapper.__call__, skip_signature_check=True)(traced_call)
        out = probe("3. C wrapper + substitute_in_graph(Wrapper.__call__)", cw, x, w, b)
        print(f"   same values as the compiled Python wrapper: {torch.equal(out, ref)}")
        try:  # a polyfill for one instance is refused: substitute_in_graph takes functions only
            torch.compiler.substitute_in_graph(bench.c_wrapper(pyw))(traced_call)
        except TypeError as e:
            print(f"   substitute_in_graph(<a Wrapper instance>): TypeError: {e}")
        # the thread's cast state is guarded as with the Python wrapper: disable_casts() recompiles
        F.linear = cw
        compiled = torch.compile(lambda t: F.linear(t, w, b), backend="eager", fullgraph=True)
        on = compiled(x).dtype
        with hmp.disable_casts():
            off = compiled(x).dtype
        print(f"   compiled C wrapper: {on} with casts on, {off} inside disable_casts() (state.off guarded)")
        # every bench site, aot_eager, fullgraph: C wrapper (polyfilled) against the Python wrapper
        a, c = torch.randn(8, 8), torch.randn(8, 8)
        for ns, attr, call in [
            (torch, "mm", lambda: torch.mm(a, c)),
            (torch, "softmax", lambda: torch.softmax(a.bfloat16(), -1)),
            (torch, "cat", lambda: torch.cat([a, c.bfloat16()])),
            (torch.Tensor, "mm", lambda: a.mm(c)),
        ]:
            site_py = getattr(ns, attr)
            outs = []
            try:
                for impl in (site_py, bench.c_wrapper(site_py)):
                    setattr(ns, attr, impl)
                    torch._dynamo.reset()
                    ex = torch._dynamo.explain(call)()
                    torch._dynamo.reset()
                    outs.append((torch.compile(call, backend="aot_eager", fullgraph=True)(), ex.graph_count))
            finally:
                setattr(ns, attr, site_py)
            (po, pg), (co, cg) = outs
            print(
                f"   {getattr(ns, '__name__', ns)}.{attr}: graphs py {pg} / C {cg}, out {co.dtype}, "
                f"identical {torch.equal(po, co) and po.dtype == co.dtype}"
            )
        # a side finding, the same for both: dynamo records a.mm(b) as a graph op without inlining the
        # wrapper on torch.Tensor; AOT then traces through it once, and disable_casts() does not recompile
        site_py = torch.Tensor.mm
        seen = []
        try:
            for impl in (site_py, bench.c_wrapper(site_py)):
                torch.Tensor.mm = impl
                torch._dynamo.reset()
                f = torch.compile(lambda: a.mm(c), backend="aot_eager", fullgraph=True)
                on = f().dtype
                with hmp.disable_casts():
                    seen.append(f"{on} then {f().dtype} in disable_casts()")
        finally:
            torch.Tensor.mm = site_py
        print(f"   a.mm(b) compiled (aot_eager): py {seen[0]}; C {seen[1]}")
        # training through aot_eager: the same graph and gradients as with the Python wrapper
        grads = {}
        for label, impl in (("py", pyw), ("c", cw)):
            F.linear = impl
            torch._dynamo.reset()
            h = x.clone().requires_grad_(True)
            for p in (w, b):
                p.grad = None
            out = torch.compile(lambda t: F.linear(t, w, b), backend="aot_eager", fullgraph=True)(h)
            out.float().sum().backward()
            grads[label] = (out, h.grad, w.grad, b.grad)
        same = all(torch.equal(p, c) and p.dtype == c.dtype for p, c in zip(grads["py"], grads["c"]))
        print(
            f"   aot_eager training, fullgraph: out {grads['c'][0].dtype}, grads {grads['c'][2].dtype}, "
            f"identical to the Python wrapper's: {same}"
        )
        # pause (prepare None) of the installed wrapper after compiling: the graph is reused in both
        # (no guard on prepare; convert()/revert() replace F.linear itself, which is guarded)
        for label, impl, pause, resume in [
            ("Python wrapper", pyw, lambda: wrap.pause(pyw), lambda p: wrap.resume(pyw, p)),
            ("C wrapper", cw, lambda: setattr(cw, "prepare", None), lambda p: setattr(cw, "prepare", p)),
        ]:
            F.linear = impl
            torch._dynamo.reset()
            compiled = torch.compile(lambda t: F.linear(t, w, b), backend="eager", fullgraph=True)
            before = compiled(x).dtype
            prepare = bench.cells(pyw)["prepare"] if impl is pyw else cw.prepare
            pause()
            try:
                after = compiled(x).dtype
            finally:
                resume(prepare)
            print(f"   {label} paused after compiling: {before} -> {after}")
    finally:
        F.linear = pyw
        hmp.revert()
    return 0


if __name__ == "__main__":
    sys.exit(main())
