"""``python -m hmp``'s subcommands: a bad flag value is argparse's usage error
(exit status 2) naming the flag and the value, not a traceback."""

import pytest

from hmp.__main__ import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["demo", "--steps", "ten"], "--steps: expected a positive integer, got 'ten'"),
        (["demo", "--batch-size", "-3"], "--batch-size: expected a positive integer, got -3"),
        (["demo", "--opt-level", "O3"], "--opt-level: invalid choice"),
        (["demo", "--device", "tpu"], "--device: invalid choice"),
        (["demo", "--seed", "-1"], "--seed: expected an integer from 0"),
        (["demo", "--long", "--steps", "5"], "argument --steps: not allowed with argument --long"),
        (["tune", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["tune", "--rounds", "two"], "--rounds: expected a positive integer, got 'two'"),
        (["tune", "--seed", "-1"], "--seed: expected an integer from 0"),
        (["tune", "--tolerance", "2"], "--tolerance: expected a fraction between 0 and 1"),
        (["tune", "--tolerance", "2%"], "--tolerance: expected a number such as 0.02, got '2%'"),
    ],
)
def test_bad_flag_values_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
