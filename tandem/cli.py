"""The ``tandem`` command: the command line's composition root; nothing of the product imports it."""

from __future__ import annotations

import argparse
import sys

from tandem.cluster import cli as cluster_cli
from tandem.loadtest.chaos.cli import register as register_chaos
from tandem.loadtest.loadgen.cli import register as register_bench
from tandem.sim.replay.cli import register as register_simulate

COMMANDS = (register_bench, register_simulate, register_chaos)


def build_parser() -> argparse.ArgumentParser:
    return cluster_cli.build_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return cluster_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
