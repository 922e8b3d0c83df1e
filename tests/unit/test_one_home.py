"""Every concept in the file named after it (issue 50): one spelling of
convert()'s options, read by plan() and every integration."""

import inspect

import hmp
from hmp.driver import plan


def test_convert_options_are_spelled_once_in_its_signature():
    """plan() and the integrations take convert()'s options by name, read from
    its signature: none of them spells an option of its own."""
    options = set(inspect.signature(hmp.convert).parameters)
    assert set(plan.PARAMETERS) == options
    assert not options & set(inspect.signature(plan.plan).parameters)
    assert set(plan.requested("O2", strict=True)) == {"opt_level", "strict"}
    try:
        from hmp.integrations.lightning import HMPFSDPPrecision, HMPPrecision
    except ImportError:  # lightning is an extra
        return
    for plugin in (HMPPrecision, HMPFSDPPrecision):
        assert not options & set(inspect.signature(plugin.__init__).parameters), plugin
