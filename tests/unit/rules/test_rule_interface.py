"""The one interface of a rule (hmp/rules/interface.py), through the driver:
its patches and hooks install and are undone with the rest, what it lacks is
said once and the rest still installs, and a change it makes after convert()
goes through the same undo log (none once reverted)."""

import types
import warnings

import pytest

import hmp
from hmp import rules
from hmp.rules.interface import Changes


class Target:
    def method(self):
        return "original"


def planted_rule(events):
    """A rule that patches Target.method, registers one hook and lacks one thing."""

    class Handle:
        def remove(self):
            events.append("hook removed")

    def register():
        events.append("hook registered")
        return Handle()

    def changes(ctx):
        events.append(ctx)
        return Changes(((Target, "method", lambda self: "patched"),), (register,), ("hmp: this torch lacks X",))

    return types.SimpleNamespace(__name__="planted", changes=changes)


@pytest.fixture
def with_planted(monkeypatch):
    events = []
    monkeypatch.setattr(rules, "RULES", (*rules.RULES, planted_rule(events)))
    yield events
    hmp.revert()


def test_a_rule_installs_through_one_call_and_is_undone_with_the_rest(with_planted):
    events = with_planted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hmp.convert()
    assert Target().method() == "patched"
    assert "hook registered" in events
    assert [str(w.message) for w in caught if "lacks X" in str(w.message)] == [
        "hmp: this torch lacks X (hmp warns about this once per process.)"
    ]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        hmp.revert()
        hmp.convert()  # said once per process
    assert not [w for w in again if "lacks X" in str(w.message)]
    hmp.revert()
    assert Target().method() == "original"
    assert events.count("hook removed") == events.count("hook registered") == 2


def test_a_change_made_later_goes_through_the_undo_log(with_planted):
    hmp.convert()
    ctx = next(e for e in with_planted if isinstance(e, rules.Context))
    assert ctx.later(Target, "extra", 1) is True
    assert Target.extra == 1
    hmp.revert()
    assert not hasattr(Target, "extra")  # undone with the rest
    assert ctx.later(Target, "extra", 2) is False  # the conversion is gone: nothing changes
    assert not hasattr(Target, "extra")
