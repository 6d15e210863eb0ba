"""``fusionp2p status`` says what each figure is: units, what "trains at" compares, peers in the short
form the logs use (issue #44)."""

from __future__ import annotations

from rich.console import Console

from fusionp2p.cli.status import bandwidth_grid, members_table
from fusionp2p.types import short_peer

A = "12D3KooWSbwQgywwmoPLxhPLtDR812UAqTa6w6798Q6z9H8u1xWS"
B = "12D3KooWF1imgEreSxMGxYKRvJm7Z2d19QyYFfUPeHG6MjaB4JeV"


def render(table: object) -> str:
    c = Console(width=250, record=True)
    c.print(table)
    return c.export_text()


def test_members_table_names_units_and_meaning() -> None:
    prof = {"name": "x86_64 (2 threads)", "flops_fp32": 3.02e10, "memory_bytes": 8 << 30}
    out = {"members": [{"peer": A, "role": "node", "alive": True, "profile": prof, "speed": 30.2, "data": [], "reach": "public"},
                       {"peer": B, "role": "node", "alive": True, "profile": prof, "speed": None, "data": [], "reach": "public"}],
           "bandwidth": [{"src": A, "dst": B, "bytes_per_s": 5e7, "rtt_s": 1e-4, "measured": True}], "dead": []}
    text = render(members_table(out))
    assert "30.20x benchmark" in text and "start-up GFLOP/s" in text and "30.2" in text
    assert "trains at: the speed it trained at in its last job" in " ".join(text.split())
    assert short_peer(A) in text and A not in text
    grid = render(bandwidth_grid(out))
    assert short_peer(A) in grid and short_peer(B) in grid
