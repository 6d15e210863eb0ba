"""The ``fusionp2p`` command: bootstrap, node, status, testbed, demo, job.

User mistakes end with one line on stderr and exit status 2; nothing here prints a traceback for
them (cli/base.py). ``node`` and ``bootstrap`` are cli/daemon_cmd.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fusionp2p.cli.base import _data_home, build_parser, run_cli, setup_logging
from fusionp2p.cli.daemon_cmd import _cpu_share, _run_daemon, _slowdown
from fusionp2p.errors import ConfigError

__all__ = ["_cpu_share", "_slowdown", "build_parser", "main", "setup_logging"]


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(argv, _dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.cmd
    if cmd in ("node", "bootstrap"):
        return _run_daemon(args)
    if cmd == "status":
        return _status(args)
    if cmd == "testbed":
        return _testbed(args)
    if cmd == "demo":
        from fusionp2p.cli.demo import run_demo

        # the demo prints its own progress; with --wan its nodes run in this process, and their INFO lines
        # (joins, accepted jobs, links) would bury it: shown with an explicit --log-level info or debug
        setup_logging(args.log_level if any(a.startswith("--log-level") for a in sys.argv) else "warning", None)
        return run_demo(nodes=args.nodes, steps=args.steps, out=Path(args.out), wan=args.wan)
    if cmd == "job":
        from fusionp2p.cli.job import cli_job

        setup_logging(args.log_level, None)
        if args.home is None:
            args.home = str(_data_home() / "client")
        return cli_job(args)
    raise ConfigError(f"unknown command {cmd}")


def _status(args: argparse.Namespace) -> int:
    from fusionp2p.cli.status import cli_status

    setup_logging(args.log_level if args.log_level != "info" else "warning", None)
    return cli_status(args)


def _testbed(args: argparse.Namespace) -> int:
    from fusionp2p.testbed import emulator as testbed

    setup_logging(args.log_level, None)
    if args.testbed_cmd == "up":
        return int(testbed.cli_up(args.spec, start_nodes=not args.no_nodes, detach=args.detach, wait_nodes=args.wait_nodes) or 0)
    return int(testbed.cli_down(args.name) or 0)




if __name__ == "__main__":
    sys.exit(main())
