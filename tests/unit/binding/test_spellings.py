"""Every spelling of a listed op follows its entry (hmp/binding/spellings.py), swept over torch's
registry: each composite operator a Python name reaches whose computation is a listed op's casts
as that op does, the testing kit's oracle says so too, and finding them touches nothing of the
user's (random state)."""

import pkgutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hmp
from hmp.binding import aten, resolve, spellings
from hmp.driver.queries import in_force
from hmp.testing import entries, expected_call

LOW = torch.bfloat16
# spellings whose public function takes other arguments than their schema: called by hand below
CALLED_BELOW = ("tensordot",)


class _Kernels(TorchDispatchMode):
    """The dtypes each computing kernel received (views aside; not the trace on meta tensors that
    decides a spelling's call: hmp/binding/picked.py)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            return func(*args, **(kwargs or {}))
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        self.seen.append((name, dtypes))
        return func(*args, **(kwargs or {}))


def _default_listed():
    """What the default conversion binds, kind by kind (the names that gain from their list)."""
    with hmp.converted():
        bound = entries.bound_names(in_force())
    return tuple((k.name, tuple(v)) for k, v in bound.items())  # the kinds by name, as the checks spell them


def _found():
    return spellings.spellings(_default_listed(), aten.python_builtins(), resolve.RNN_KERNELS)


def _cpu(args, dtype):
    return [
        torch.rand(a.shape, dtype=dtype) + 0.5
        if isinstance(a, torch.Tensor)
        else [torch.rand(t.shape, dtype=dtype) + 0.5 for t in a]
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
        else a
        for a in args
    ]


def _probe(name):
    """Probe arguments (meta) for ``aten::name``'s first single-Tensor overload that runs."""
    packet = aten.aten_op(name)
    builtin = dict(aten.python_builtins()).get(name)
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        for shape in spellings.SHAPES:
            args = spellings.probe_args(schema, shape)
            if args is not None and spellings.traced(builtin, args) is not None:
                return builtin, args
    raise AssertionError(name)


def test_the_spellings_users_write_are_found():
    found = {spelling: (kind, name) for kind, name, spelling in _found()}
    for spelling, kind in [
        ("linalg_matmul", "bf16"),
        ("einsum", "bf16"),
        ("tensordot", "bf16"),
        ("inner", "bf16"),
        ("linalg_multi_dot", "bf16"),
        ("special_softmax", "fp32"),
        ("special_log_softmax", "fp32"),
        ("true_divide", "fp32"),
    ]:
        assert found[spelling][0] == kind, (spelling, found.get(spelling))
    assert found["linalg_matmul"][1] == "matmul"  # the entry with its very schema names it
    # linear with a bias runs addmm: no spelling of matmul, whatever its bias-less call computes
    with_matmul_only = spellings.spellings((("bf16", ("matmul",)),), aten.python_builtins(), resolve.RNN_KERNELS)
    spelled = {s for _, _, s in with_matmul_only}
    assert "linear" not in spelled and "linalg_matmul" in spelled
    # an op with other work besides a listed one's is no spelling of it: pinverse runs an SVD, then mm
    assert "pinverse" not in found and "linalg_pinv" not in found


@pytest.mark.parametrize("kind_name_spelling", _found(), ids=lambda t: t[2])
def test_every_spelling_casts_as_its_entry_does(kind_name_spelling):
    """Independently of hmp's bookkeeping: the kernel the spelling reaches gets the dtype the
    listed op's own call gives that kernel, under convert(), on CPU tensors."""
    kind, name, spelling = kind_name_spelling
    builtin, meta_args = _probe(spelling)
    entry_fn, entry_meta = _probe(name) if aten.aten_op(name) is not None else (None, None)
    src = torch.float32 if kind == "bf16" else LOW  # what the entry's rule changes
    want = {"bf16": LOW, "fp32": torch.float32, "promote": None}[kind]
    # each place a user reaches it, looked up while converted (a reference taken before is never cast):
    # the namespaces' builtins (torch._VF's is private: torch.einsum is what users call) and the public name
    lookups = [lambda m=m, a=a: getattr(m, a) for _, m, a in aten.aten_entry_points().get(spelling, ())]
    public = _public(spelling)
    if public is not None and _accepts(public, meta_args):
        lookups.append(lambda: _public(spelling))
    ran = 0
    for lookup in lookups:
        form = _form(lookup(), meta_args)
        if form is None:  # a Python function with its own calling convention (tensordot's dims=)
            continue
        ran += 1
        args = form(_cpu(meta_args, src))
        with hmp.converted():
            live = lookup()
            with _Kernels() as k:
                live(*args)
        kernels = {op for ops in spellings.computation(spelling, builtin) for op in ops}
        computing = [d for n, d in k.seen if n in kernels]
        assert computing, (spelling, k.seen)
        if want is not None:
            assert all(d and all(x == want for x in d) for d in computing), (spelling, live, k.seen)
    assert ran or spelling in CALLED_BELOW, spelling
    if entry_fn is not None and want is not None:  # the entry itself, as a control
        args = _cpu(entry_meta, src)
        with hmp.converted():
            live = _public(name)  # looked up while converted: a reference taken before is never cast
            live = live if live is not None and _accepts(live, entry_meta) else entry_fn
            with _Kernels() as k:
                live(*_form(live, entry_meta)(args))
        assert any(d and all(x == want for x in d) for _, d in k.seen), (name, k.seen)


def _form(fn, meta_args):
    """How the public function takes the schema's arguments: as they are, or a sole list spread
    (torch.chain_matmul takes *matrices); None when neither runs."""
    forms = [lambda a: a] + ([lambda a: a[0]] if len(meta_args) == 1 and isinstance(meta_args[0], list) else [])
    for form in forms:
        try:
            fn(*form(meta_args))
            return form
        except Exception:
            pass
    return None


def _accepts(fn, meta_args):
    return _form(fn, meta_args) is not None


def _public(spelling):
    """The public Python function a user calls for an aten name (torch.linalg.matmul for linalg_matmul)."""
    for path in (f"torch.{spelling}", f"torch.nn.functional.{spelling}"):
        try:
            return pkgutil.resolve_name(path)
        except (AttributeError, ValueError, ImportError):
            pass
    prefix, _, rest = spelling.partition("_")
    sub = getattr(torch, prefix, None)
    return getattr(sub, rest, None) if rest and sub is not None and not callable(sub) else None


def test_the_oracle_agrees_with_hmp_on_every_spelling():
    for kind, _name, spelling in _found():
        if spelling in CALLED_BELOW:
            continue
        builtin, meta_args = _probe(spelling)
        args = _cpu(meta_args, torch.float32 if kind == "bf16" else LOW)
        with hmp.converted():
            public = _public(spelling)
            fn = public if public is not None and _accepts(public, meta_args) else builtin
            args = _form(fn, meta_args)(args)
            expected = expected_call(fn, *args)
            got = fn(*args).dtype
        assert not expected.left_to_torch, (spelling, expected.rule)
        assert expected.dtype == got, (spelling, expected.rule, got)


def test_user_calls_of_aliases_run_as_their_entries():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with hmp.converted():
        assert torch.linalg.matmul(x, w).dtype == LOW
        assert torch.einsum("ij,jk->ik", x, w).dtype == LOW
        assert torch.tensordot(x, w, dims=1).dtype == LOW
        assert expected_call(torch.tensordot, x, w, dims=1).dtype == LOW  # the oracle agrees
        assert torch.special.softmax(x.to(LOW), 1).dtype == torch.float32
        assert torch.special.log_softmax(x.to(LOW), 1).dtype == torch.float32
        assert F.softmax.__module__.startswith("hmp") or F.softmax(x.to(LOW), 1).dtype == torch.float32
    assert torch.linalg.matmul(x, w).dtype == torch.float32  # reverted


def test_a_user_list_without_the_entry_binds_no_spelling(tmp_path):
    path = tmp_path / "bf16.txt"
    path.write_text("linear\n")  # no matmul, mm, bmm: linalg.matmul is still linear's computation on 2-D
    with hmp.converted(bf16_file_path=str(path)):
        assert torch.einsum("bij,bjk->bik", torch.randn(2, 3, 4), torch.randn(2, 4, 5)).dtype == torch.float32


def test_finding_spellings_touches_no_random_state():
    spellings.computation.cache_clear()
    spellings.spellings.cache_clear()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    _found()
    assert torch.equal(torch.get_rng_state(), state)
