"""Sizes a user writes on the command line (``--memory 3GiB``, ``--disk 20G``), parsed in one place.

Units follow docker's and the IEC's reading: a bare letter and the ``iB`` forms are powers of 1024
(``20G`` = ``20GiB`` = 20 x 2**30), the SI forms with ``B`` are powers of 1000 (``2.5GB`` = 2.5e9);
no unit is bytes.
"""

from __future__ import annotations

from fusionp2p.errors import ConfigError

_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str, flag: str = "--memory") -> int:
    """``"3GiB"``, ``"20G"``, ``"2.5GB"`` or a byte count -> bytes; a one-line ConfigError naming *flag*
    and what to write otherwise."""
    t = text.strip().upper().replace(" ", "")
    base = 1024
    if t.endswith("IB"):
        t = t[:-2]
    elif t.endswith("B") and len(t) > 1 and t[-2] in _POWER:
        t, base = t[:-1], 1000
    elif t.endswith("B"):
        t = t[:-1]
    unit = t[-1:] if t[-1:] in _POWER and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)]) * base ** _POWER[unit]
    except ValueError:
        value = -1.0
    if not 1 <= value < 2**63:      # also refuses nan and inf
        raise ConfigError(f"{flag} {text!r}: give a size such as 3GiB, 20G, 512MiB or 2.5GB")
    return int(value)


__all__ = ["parse_size"]
