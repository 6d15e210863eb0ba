"""``fusionp2p node --memory SIZE`` (issue 37): the memory a node offers, parsed, defaulted and checked."""

from __future__ import annotations

import pytest

from fusionp2p.cli.main import build_parser, main
from fusionp2p.errors import ConfigError
from fusionp2p.sizes import parse_size
from fusionp2p.swarm.device import MEMORY_HEADROOM_MIN, offered_memory

BOOT = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWLK6ngBJz8BZrs3HnzCXQJdQbadX7z2iqbp7crfMrrrTT"


@pytest.mark.parametrize(("text", "size"), [
    ("3GiB", 3 * 2**30), ("3gib", 3 * 2**30), ("512MiB", 512 * 2**20), ("2.5GB", 2_500_000_000), ("1e9", 10**9),
    ("4096", 4096), ("1 TiB", 2**40), ("64k", 64 << 10), ("20G", 20 << 30), ("1.5t", int(1.5 * (1 << 40))), ("100b", 100),
])
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "3 GiBs", "-1GiB", "0", "nan", "inf", "1e30", "3XB"])
def test_a_bad_size_says_what_to_write(text: str) -> None:
    with pytest.raises(ConfigError, match="--memory"):
        parse_size(text)


def test_the_default_offer_leaves_a_stated_headroom() -> None:
    assert offered_memory(64 << 30) == (64 << 30) - int((64 << 30) * 0.1)     # 10% of a large machine
    assert offered_memory(2 << 30) == (2 << 30) - MEMORY_HEADROOM_MIN         # at least 512 MiB
    assert offered_memory(600 << 20) == 300 << 20                             # never under half
    assert offered_memory(0) == 0


def test_the_node_command_takes_memory_and_refuses_a_bad_one_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["node", "--bootstrap", BOOT, "--memory", "3GiB"])
    assert args.memory == "3GiB"
    assert main(["node", "--bootstrap", BOOT, "--home", "/nonexistent/fp2p-test", "--memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory" in err and "3GiB" in err, err


def test_memory_is_the_process_total_and_a_stage_gets_what_its_footprint_and_reserve_leave() -> None:
    from fusionp2p.swarm.device import NODE_RESERVE, resident, stage_memory_of

    assert stage_memory_of(3 << 30, 400 << 20) == (3 << 30) - (400 << 20) - NODE_RESERVE
    with pytest.raises(ConfigError, match=r"leaves no room for a stage.*at least --memory \d+MiB"):
        stage_memory_of(2_400_000, 300 << 20)                     # a few MB: under the process's own footprint
    rss, peak = resident()
    assert 0 < rss <= peak                                        # Linux: this process's own figures
