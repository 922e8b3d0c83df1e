"""Command line: ``python -m hmp demo``, ``python -m hmp run script.py [args]`` (or ``hmp demo``, ...: the
installed script)."""

import argparse
import importlib
import os
import platform
import sys

import torch

from hmp.version import __version__

# subcommand -> the module that defines it with add_parser(subparsers); a
# module is imported only when its subcommand is asked for (all of them for
# --help), and one that is not there is left out.
SUBCOMMANDS = {
    "demo": "hmp.demo",
    "run": "hmp.integrations.habana_runner",
    "tune": "hmp.tools.tune_cli",
    "audit": "hmp.tools.audit_cli",
    "profile": "hmp.tools.profile_cli",
    "check": "hmp.tools.check_cli",
}


def _load(module_name):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return None


def _version():
    return f"hmp {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def invoked_as(argv0=None):
    """How the user ran hmp, for usage lines: ``hmp`` (the installed script) or ``python -m hmp``."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return "hmp" if name in ("hmp", "hmp.exe") else "python -m hmp"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog=invoked_as(), description="hmp: list-driven mixed precision for PyTorch")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = [argv[0]] if argv and argv[0] in SUBCOMMANDS else list(SUBCOMMANDS)
    for command in wanted:
        module = _load(SUBCOMMANDS[command])
        if module is not None:
            module.add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
