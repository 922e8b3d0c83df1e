"""Argument types the command line's subcommands share: a bad value is
argparse's usage error naming the flag and the value, not a traceback."""

import argparse


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def seed(text):
    """What torch.manual_seed takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63-1, got {value}")
    return value


def fraction(text):
    """A share strictly between 0 and 1 (0.02 is 2%)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 0.02, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1 (0.02 is 2%), got {value}")
    return value
