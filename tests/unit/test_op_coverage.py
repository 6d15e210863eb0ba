"""docs/operators.md is generated from the whitelist and lists exactly its operators."""

from __future__ import annotations

from pathlib import Path

from fusionp2p.graph.ops import WHITELIST
from fusionp2p.testing.opcoverage import listed

DOC = Path(__file__).resolve().parents[2] / "docs" / "operators.md"


def test_operator_table_lists_exactly_the_whitelist() -> None:
    got = listed(DOC.read_text())
    assert got == WHITELIST, (f"docs/operators.md is stale: missing {sorted(WHITELIST - got)}, extra "
                              f"{sorted(got - WHITELIST)}; run python -m fusionp2p.testing.opcoverage > docs/operators.md")
