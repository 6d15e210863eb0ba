"""The shadow copies' configuration (``jobs/shadow.py``, docs/jobs.md "Shadow copies"): a module of its own
so that ``jobs/host.py``, which holds it in its config, does not import ``jobs/shadow.py``, which runs on a
host (it was an import cycle, host <-> shadow)."""

from __future__ import annotations

from dataclasses import dataclass

from fusionp2p.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowConfig:
    """Background copies of single-replica stages (``jobs/shadow.py``'s docstring)."""

    enabled: bool = True
    share: float = 0.25     # of the step time that copies may take (the cadence rule)
    max_every: int = 4      # steps between two copies at most: with share, the steps a death costs
    keep: int = 2           # copies of one stage a keeper holds (the newest)

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ConfigError("ShadowConfig.share must be in (0, 1]")
        if self.max_every < 1 or self.keep < 1:
            raise ConfigError("ShadowConfig.max_every and keep must be >= 1")


__all__ = ["ShadowConfig"]
