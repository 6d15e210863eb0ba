"""Measure this node's device: matmul FLOP/s (fp32 and bf16 where supported), memory, versions."""

from __future__ import annotations

import os
import platform
import time

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.types import DeviceProfile


def parse_device(spec: str) -> torch.device:
    """'cpu' or 'cuda:N'; ConfigError with what to do otherwise."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {spec!r}; use cpu or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec} requested but CUDA is not available here; use --device cpu")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"device {spec} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"unsupported device {spec!r}; use cpu or cuda:N")
    return dev


def _matmul_rate(dev: torch.device, dtype: torch.dtype, seconds: float, n: int) -> float:
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    (a @ b).sum().item()  # warm-up
    reps = 0
    t0 = time.perf_counter()
    while True:
        c = a @ b
        reps += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if time.perf_counter() - t0 >= seconds:
            break
    del c
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def measure_profile(device: str = "cpu", *, seconds: float = 0.2) -> DeviceProfile:
    """A short benchmark of the device (blocking: call it in a worker thread)."""
    dev = parse_device(device)
    n = 512 if dev.type == "cpu" else 4096
    fp32 = _matmul_rate(dev, torch.float32, seconds, n)
    try:
        bf16 = _matmul_rate(dev, torch.bfloat16, seconds / 2, n)
    except RuntimeError:
        bf16 = 0.0
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        mem, name = int(free), torch.cuda.get_device_name(dev)
    else:
        mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
        name = f"{platform.machine()} ({torch.get_num_threads()} threads)"
    versions = (("python", platform.python_version()), ("torch", torch.__version__))
    return DeviceProfile(device=str(dev), kind=dev.type, name=name, flops_fp32=fp32, flops_bf16=bf16,
                         memory_bytes=mem, threads=torch.get_num_threads(), versions=versions)
