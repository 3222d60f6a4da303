"""The ``tandem`` command (pyproject's entry point): the composition root of the command line.

It sits above every room: the cluster's commands (``generate``, ``serve``: cluster/cli.py, which
also owns the parser frame and the exit statuses), the load tests' (``bench``:
loadtest/loadgen/cli.py, ``chaos``: loadtest/chaos/cli.py) and the trace replay (``simulate``:
sim/replay/cli.py) meet only here, so cluster/ never imports loadtest/. Nothing of the product
imports this module.
"""

from __future__ import annotations

import sys

from tandem.cluster import cli as cluster_cli
from tandem.loadtest.chaos.cli import register as register_chaos
from tandem.loadtest.loadgen.cli import register as register_bench
from tandem.sim.replay.cli import register as register_simulate

COMMANDS = (register_bench, register_simulate, register_chaos)


def build_parser():
    """``tandem``'s parser with every command (``tandem --help`` lists them)."""
    return cluster_cli.build_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return cluster_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
