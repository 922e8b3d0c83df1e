"""Argument types the command line's subcommands share: a bad value is
argparse's usage error naming the flag and the value, not a traceback."""

import argparse


def _checked(text, convert, expected, within, expected_range):
    """``convert(text)`` where that parses and ``within`` holds of it; otherwise
    a usage error saying what was expected and what was given."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not within(value):
        raise argparse.ArgumentTypeError(f"expected {expected_range}, got {value}")
    return value


def positive_int(text):
    return _checked(text, int, "a positive integer", lambda v: v > 0, "a positive integer")


def seed(text):
    """What torch.manual_seed takes."""
    return _checked(text, int, "a non-negative integer", lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63-1")


def fraction(text):
    """A share strictly between 0 and 1 (0.02 is 2%)."""
    return _checked(
        text, float, "a number such as 0.02", lambda v: 0 < v < 1, "a fraction between 0 and 1 (0.02 is 2%)"
    )
