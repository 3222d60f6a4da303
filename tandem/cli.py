"""The ``tandem`` command (pyproject's entry point): the composition root of the command line.

It sits above every room: the cluster's commands (``generate``, ``serve``: cluster/cli.py, which
also owns the parser frame and the exit statuses) and bench's (``bench``: bench/loadgen/cli.py,
``simulate``: bench/sim/cli.py, ``chaos``: bench/chaos/cli.py) meet only here, so cluster/ never imports bench/. Nothing of the
product imports this module.
"""

from __future__ import annotations

import sys

from tandem.bench.chaos.cli import register as register_chaos
from tandem.bench.loadgen.cli import register as register_bench
from tandem.bench.sim.cli import register as register_simulate
from tandem.cluster import cli as cluster_cli

COMMANDS = (register_bench, register_simulate, register_chaos)


def build_parser():
    """``tandem``'s parser with every command (``tandem --help`` lists them)."""
    return cluster_cli.build_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return cluster_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
