"""The one abi3 binary on every CPython it claims (>= 3.9), without torch:
a stand-in tensor type exercises the Wrapper's paths.

    for v in 3.9 3.10 3.11 3.12 3.13; do python$v benchmarks/cbody/abi3_smoke.py; done
"""

import os
import sys
import threading
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cbody  # noqa: E402  (_cbody.abi3.so)


class Tensor:
    def __init__(self, dtype):
        self.dtype = dtype


class Parameter(Tensor):
    pass


F32, BF16, F16, F64 = "f32", "bf16", "f16", "f64"  # stand-in dtypes: compared by identity
PROMOTE, RAISE = object(), object()


class State(threading.local):
    off = 0


tls = State()
seen = []


def rescue(exc, op, wrapped, args, kwargs, a, k):
    return "rescued" if isinstance(exc, KeyError) else RAISE


_cbody.setup(
    tensor=Tensor,
    parameter=Parameter,
    floats=(F16, BF16, F32, F64),
    promote=PROMOTE,
    off=1,
    cast_seq=None,
    is_number=lambda t: False,
    after=lambda *a: None,
    rescue=rescue,
    raise_=RAISE,
    method_type=types.MethodType,
)


def op(*args, **kwargs):
    seen.append(tls.off)
    if kwargs.get("fail"):
        raise kwargs["fail"]
    return tuple(getattr(a, "dtype", a) for a in args)


def prepare(args, kwargs):
    return tuple(Tensor(BF16) if isinstance(a, Tensor) and a.dtype is F32 else a for a in args), kwargs


def main():
    w = _cbody.Wrapper(op, prepare, frozenset([F32]), lambda t: Tensor(BF16), None, 1 << 62, False, None, tls)
    out = w(Tensor(F32), Tensor(F16), 3)
    assert out == (BF16, F16, 3), out
    nested = w([Tensor(F32), (Tensor(F32), 2)])[0]  # lists and tuples, at any depth
    assert [nested[0].dtype, nested[1][0].dtype, nested[1][1]] == [BF16, BF16, 2], nested
    assert seen[-1] == 1 and tls.off == 0  # off inside the op, 0 after
    assert w(Tensor(F32), fail=KeyError()) == "rescued" and tls.off == 0  # keywords: prepare; rescue
    try:
        w(Tensor(F32), fail=ValueError("x"))
        raise AssertionError("no error")
    except ValueError:
        assert tls.off == 0
    tls.off = 1
    assert w(Tensor(F32)) == (F32,)  # casts off: a plain call
    tls.off = 0
    p = _cbody.Wrapper(op, prepare, PROMOTE, None, None, 1 << 62, False, None, tls)
    assert p(Tensor(F32), Tensor(F32)) == (F32, F32)  # one dtype: as given
    assert p(Tensor(F32), Tensor(BF16)) == (BF16, BF16)  # mixed: prepare (here: the stand-in's)
    Tensor.method = w  # a method, as torch.Tensor.mm
    assert Tensor(F32).method(Tensor(F32)) == (BF16, BF16)
    w.prepare = None  # paused
    assert w(Tensor(F32)) == (F32,)
    w.__name__ = "linear"
    assert w.__dict__["__name__"] == "linear"
    print(f"ok: {sys.version.split()[0]} loads {_cbody.__file__.rsplit(os.sep, 1)[-1]} and runs it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
