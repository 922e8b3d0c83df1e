"""Command line: ``python -m hmp demo`` (and later subcommands)."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hmp", description="hmp: list-driven mixed precision for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo

    demo.add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
