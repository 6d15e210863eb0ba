"""py-libp2p's log level in a daemon's <home>/libp2p.log (cli/base.py setup_logging): DEBUG with --log-level
debug unless --libp2p-log-level says otherwise. benchmarks.membership --log-dir wants our debug log but not
py-libp2p's, whose DEBUG was ~20% of a probing node's event-loop samples (py-spy, 20 processes, 2026-11-30)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fusionp2p.cli.base import build_parser, setup_logging


@pytest.fixture
def libp2p_logger():  # type: ignore[no-untyped-def]
    lp = logging.getLogger("libp2p")
    ours = logging.getLogger("fusionp2p")
    saved = (lp.level, list(lp.handlers), lp.propagate, ours.level)
    yield lp
    for h in list(lp.handlers):
        lp.removeHandler(h)
        h.close()
    lp.setLevel(saved[0])
    for h in saved[1]:
        lp.addHandler(h)
    lp.propagate = saved[2]
    ours.setLevel(saved[3])


def test_debug_takes_libp2p_along_unless_told(libp2p_logger: logging.Logger, tmp_path: Path) -> None:
    setup_logging("debug", tmp_path / "a.log")
    assert libp2p_logger.level == logging.DEBUG
    setup_logging("info", tmp_path / "b.log")
    assert libp2p_logger.level == logging.INFO
    setup_logging("debug", tmp_path / "c.log", "info")
    assert libp2p_logger.level == logging.INFO
    assert logging.getLogger("fusionp2p").level == logging.DEBUG   # ours still at debug


def test_the_daemons_take_the_flag() -> None:
    for cmd in (["node", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x"], ["bootstrap"]):
        args = build_parser().parse_args([*cmd, "--log-level", "debug", "--libp2p-log-level", "warning"])
        assert args.libp2p_log_level == "warning"
        assert build_parser().parse_args(cmd).libp2p_log_level is None
