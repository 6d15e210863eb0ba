"""Deterministic, seeded batch sampling aligned by ``(step, micro)`` across nodes.

Theory of operation. The stream of ``N`` tokens is cut into ``W = (N - 1) // seq_len`` windows;
window ``w`` gives inputs ``tokens[w*T : w*T + T]`` and targets ``tokens[w*T + 1 : w*T + T + 1]``
(T = seq_len). Samples are drawn without replacement, epoch by epoch: global sample number
``g = (step * micro_batches + micro) * micro_batch + b`` falls in epoch ``g // W`` at position
``g % W`` of a permutation seeded by ``(seed, epoch)``. So the sample of any ``(step, micro, b)`` is
a pure function of the config: the first pipeline stage (which reads inputs) and the last stage
(which reads targets) draw the very same windows without talking to each other, a resumed job
continues the data order exactly, and no sample repeats within an epoch.

Pure: no I/O, no global RNG (a fresh ``numpy.random.Generator(PCG64)`` per epoch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fusionp2p.data.shards import ShardedTokens, ShardManifest, TokenArray
from fusionp2p.errors import ConfigError

_SEED_DOMAIN = 0x46503250  # "FP2P": keeps these streams apart from other users of the same seed


def check_batch_shape(cfg: Any, names: tuple[str, ...] = ("seq_len", "micro_batch", "micro_batches")) -> None:
    """The checks every sampler config shares: positive integer ``seq_len``, ``micro_batch`` and
    ``micro_batches`` (or *names*), and a ``seed`` in [0, 2**63) (ConfigError, one line)."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError("seed must be in [0, 2**63)")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerConfig:
    num_tokens: int
    seq_len: int
    micro_batch: int
    micro_batches: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_batch_shape(self)
        if self.num_tokens < self.seq_len + 1:
            raise ConfigError(f"{self.num_tokens} tokens cannot make one sample of seq_len {self.seq_len}; use more data")

    @property
    def num_windows(self) -> int:
        return (self.num_tokens - 1) // self.seq_len


class BatchSampler:
    """Which windows make up micro-batch ``(step, micro)``; and their inputs and targets."""

    __slots__ = ("_perm", "config")

    def __init__(self, config: SamplerConfig) -> None:
        self.config = config
        self._perm = functools.lru_cache(maxsize=2)(self._permutation)

    def _permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        rng = np.random.Generator(np.random.PCG64([_SEED_DOMAIN, self.config.seed, epoch]))
        return rng.permutation(self.config.num_windows).astype(np.int64)

    def windows(self, step: int, micro: int) -> npt.NDArray[np.int64]:
        """Window indices of the ``micro_batch`` samples of ``(step, micro)``."""
        c = self.config
        if step < 0 or not 0 <= micro < c.micro_batches:
            raise IndexError(f"(step={step}, micro={micro}) out of range (micro_batches={c.micro_batches})")
        w = c.num_windows
        g0 = (step * c.micro_batches + micro) * c.micro_batch
        out = np.empty(c.micro_batch, dtype=np.int64)
        for b in range(c.micro_batch):  # at most two epochs per micro-batch unless W < micro_batch
            epoch, pos = divmod(g0 + b, w)
            out[b] = self._perm(epoch)[pos]
        return out

    def starts(self, step: int, micro: int) -> npt.NDArray[np.int64]:
        """First token index of each sample of ``(step, micro)``."""
        return self.windows(step, micro) * self.config.seq_len

    def shards_for(self, manifest: ShardManifest, step: int, micro: int) -> list[int]:
        """Shard indices a node must hold to read ``(step, micro)`` (inputs and targets both)."""
        need: set[int] = set()
        for s in self.starts(step, micro):
            need.update(manifest.shards_for(int(s), self.config.seq_len + 1))
        return sorted(need)

    def _read(self, src: TokenArray | ShardedTokens, step: int, micro: int, offset: int) -> npt.NDArray[np.int64]:
        t = self.config.seq_len
        out = np.empty((self.config.micro_batch, t), dtype=np.int64)
        for b, s in enumerate(self.starts(step, micro)):
            lo = int(s) + offset
            out[b] = src.window(lo, t) if isinstance(src, ShardedTokens) else src[lo : lo + t]
        return out

    def inputs(self, src: TokenArray | ShardedTokens, step: int, micro: int) -> npt.NDArray[np.int64]:
        """``[micro_batch, seq_len]`` input ids (what the first stage reads)."""
        return self._read(src, step, micro, 0)

    def targets(self, src: TokenArray | ShardedTokens, step: int, micro: int) -> npt.NDArray[np.int64]:
        """``[micro_batch, seq_len]`` next-token targets (what the last stage reads)."""
        return self._read(src, step, micro, 1)
