"""The list kinds (issue 50): one record per kind in hmp/binding/kinds.py, read by
everything that treats a list by its kind; an unknown kind raises where a
kind is looked up, and a kind added to the registry is picked up by the
pieces that read it."""

import dataclasses
import inspect
import warnings

import pytest
import torch

import hmp
from hmp.binding import kinds, list_files, lists, modules, pays, sites, wrapper_life
from hmp.binding.list_files import default_path
from hmp.binding.resolve import Binding, Resolver, attribute_site
from hmp.core import cast_copies, policy
from hmp.core.dtypes import BF16, FLOATS, FP16, FP32, FP64
from hmp.driver import conversion, plan

FINITE_CASTS = dict(cast_copies.ROUNDING_CASTS)


def test_every_kind_has_a_complete_record_that_matches_convert():
    params = plan.PARAMETERS
    assert set(params) == set(inspect.signature(hmp.convert).parameters)
    assert len(set(kinds.names())) == len(kinds.KINDS) == 3
    assert kinds.kind("bf16") is kinds.LOWER  # the lower list keeps Habana's public name
    # every list file parameter of convert() but the lower list's float16 spelling is one kind's
    files = {p for p in params if p.endswith("_file_path")} - {"fp16_file_path", "uncast_file_path"}
    assert files == {k.parameter for k in kinds.KINDS}
    assert {p for p in params if p.endswith("_modules")} == {
        k.modules_parameter for k in kinds.KINDS if k.takes_modules
    }
    x = torch.ones(2, dtype=FP32)
    for k in kinds.KINDS:
        assert kinds.kind(k.name) is k and kinds.kind(k) is k
        assert k.title and k.file_title and k.name in k.parameter
        assert params[k.parameter].default == ""
        assert callable(getattr(hmp, f"{k.name}_function"))
        assert k.title_in(None) == k.title
        for var in k.environ:
            assert var.isupper(), var
        for opt_level in kinds.OPT_LEVELS:
            for low in (BF16, FP16):
                for strict in (False, True):
                    path = default_path(k.default_file(opt_level, low, strict))
                    assert path.is_file(), (k.name, opt_level, low, strict)
        for name in {*k.defaults.values(), *k.o1_defaults.values()}:
            # a shipped default loads as a file of its kind: module entries only where the kind takes them
            lists.load(default_path(name), Resolver(), k.file_title, modules=k.takes_modules)
        # the record names the call path's functions (it imports none of them): each name is one
        prepare = sites.factory(k.policy)(BF16, FINITE_CASTS)
        args, kwargs = prepare((x,), {})
        assert isinstance(args, tuple) and kwargs == {}
        for named in (k.norms, *(k.fallback or ())):
            assert named is None or callable(sites.factory(named)), named
        assert k.lean.one_dtype or (k.lean.src and k.lean.src <= FLOATS)
        if k.takes_modules:
            assert callable(getattr(modules.Forwards, k.module_rule)) and k.module_says
    assert kinds.LOWER.title_in(BF16) == "BF16" and kinds.LOWER.title_in(FP16) == "FP16"
    assert kinds.LOWER.default_file("O1", FP16) == "fp16.txt"
    # the records are what convert() reads: the defaults in force are the records' files
    hmp.convert()
    try:
        in_force = hmp.effective_lists()
    finally:
        hmp.revert()
    assert list(in_force) == list(kinds.names())
    for k in kinds.KINDS:
        shipped = set(list_files.names(default_path(k.default_file("O1"))))
        assert set(in_force[k.name]) <= shipped | set().union(*(in_force[o.name] for o in kinds.KINDS if o is not k))


@pytest.mark.parametrize("unknown", ["fp8", "BF16", "lower", None])
def test_an_unknown_kind_raises_where_a_kind_is_looked_up(unknown):
    with pytest.raises(ValueError, match="unknown list kind"):
        kinds.kind(unknown)
    with pytest.raises(ValueError, match="kind must be one of"):
        hmp.register(torch, "mm", unknown)


def test_a_kind_without_a_rule_says_so():
    forwards = modules.Forwards(BF16, FINITE_CASTS, set())
    with pytest.raises(ValueError, match="takes no module entries"):
        forwards.replacing(kinds.PROMOTE, torch.nn.Linear.forward)
    with pytest.raises(ValueError, match="no rule to an op in no list"):
        sites.fallback_of(kinds.LOWER)


def to_float64(low, casters, out=None):
    """A new kind's policy: every other floating tensor to float64."""
    return policy.to_dtype(frozenset((BF16, FP16, FP32)), casters[FP64].any, out)


@pytest.fixture
def fp64_kind(tmp_path, monkeypatch):
    """A kind added as the issue says one is: one record, one policy, one list
    file, and convert()'s parameter (here in plan's copy of the signature:
    convert()'s public signature stays as it is)."""
    shipped = tmp_path / "fp64.txt"
    shipped.write_text("logaddexp\n")
    record = kinds.Kind(
        name="fp64",
        title="FP64",
        file_title="FP64 list file",
        parameter="fp64_file_path",
        defaults={level: str(shipped) for level in kinds.OPT_LEVELS},
        policy="to_float64",
        lean=kinds.Lean(frozenset((BF16, FP16, FP32)), FP64),
        module_rule="in_float32",
        modules_parameter="fp64_modules",
        module_says="the whole forward in float32",
        guards_defaults=False,
    )
    monkeypatch.setattr(kinds, "KINDS", kinds.KINDS + (record,))
    monkeypatch.setattr(policy, "to_float64", to_float64, raising=False)  # its policy, in policy.py's place
    monkeypatch.setitem(sites.POLICIES, "to_float64", to_float64)  # and in the table kinds' names are read from
    parameters = dict(plan.PARAMETERS)
    for name in (record.parameter, record.modules_parameter):
        default = "" if name.endswith("_path") else None
        parameters[name] = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
    monkeypatch.setattr(plan, "PARAMETERS", parameters)
    return record


def test_a_kind_added_to_the_registry_is_picked_up(fp64_kind):
    assert kinds.kind("fp64") is fp64_kind and "fp64" in kinds.names()
    assert "hmp: unknown list kind 'fp8'; the kinds are bf16, fp32, promote, fp64" in _raised(kinds.kind, "fp8")
    x = torch.ones(3, dtype=FP32)
    # the policy factory
    (cast,), _ = sites.for_kind(fp64_kind, BF16, FINITE_CASTS)((x,), {})
    assert cast.dtype == FP64
    # the lean path's rule, and the wrapper's prepare
    wrappers = sites.Wrappers(BF16, FINITE_CASTS)
    wrapper = wrappers.site(Binding(attribute_site(torch, "logaddexp"), fp64_kind, "logaddexp"), torch.logaddexp)
    fields = wrapper_life.fields(wrapper)
    assert fields["src"] == frozenset((BF16, FP16, FP32)) and fields["cast"] == FINITE_CASTS[FP64]
    assert wrappers.user_prepare(fp64_kind, "f")((x,), {})[0][0].dtype == FP64
    # the module rule
    forwards = modules.Forwards(BF16, FINITE_CASTS, set())
    original = torch.nn.Linear.forward
    assert forwards.replacing(fp64_kind, original).__code__ is forwards.in_float32(original).__code__
    # which entries bind, and the lists
    assert pays.decision(fp64_kind, "logaddexp", False, frozenset()) == (True, pays.CAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops, classes = lists.effective(Resolver(), environ={})
    assert ops[fp64_kind] == {"logaddexp"} and classes[fp64_kind] == []
    # convert(), end to end: the new list's op runs in float64, the others as before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = plan.plan(plan.Requested())
        assert planned.modules[fp64_kind] == ()
        conversion.apply(planned)
    try:
        assert torch.logaddexp(x, x).dtype == FP64
        assert torch.mm(x[None], x[:, None]).dtype == BF16
        assert hmp.effective_lists()["fp64"] == ["logaddexp"]
        detail = hmp.effective_lists(detail=True)
        assert detail["fp64"] == {"logaddexp": pays.CAST}
    finally:
        hmp.revert()
    assert torch.logaddexp(x, x).dtype == FP32


def _raised(fn, *args):
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value)


def test_every_name_a_record_gives_is_a_factory_of_the_table():
    """The policy link is a table (sites.POLICIES), not a getattr on policy.py: each name a kind's
    record or its fallback gives is there, and is the factory of that name."""
    for k in kinds.KINDS:
        fb = k.fallback
        for name in (k.policy, k.norms, *((fb.needs, fb.policy, fb.retry) if fb else ())):
            if name is not None:
                assert sites.factory(name) is getattr(policy, name), (k.name, name)
    with pytest.raises(KeyError):
        sites.factory("cast_each")  # a function of policy.py that is no kind's factory


def test_records_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        kinds.LOWER.name = "lower"


def test_a_binding_carries_its_kinds_record():
    # a name becomes a record once, where lists' names enter (convert(), register()); sites read the record
    bound = Resolver().bind({kinds.LOWER: {"mm"}, kinds.FP32: {"softmax"}})
    by_name = {b.name: b.kind for b in bound}
    assert by_name["mm"] is kinds.LOWER and by_name["softmax"] is kinds.FP32
    wrapper = sites.Wrappers(BF16, FINITE_CASTS).site(next(b for b in bound if b.name == "mm"), torch.mm)
    with hmp.converted():
        assert wrapper(torch.randn(2, 2), torch.randn(2, 2)).dtype == BF16
