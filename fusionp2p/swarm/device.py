"""Measure this node's device: matmul FLOP/s (fp32 and bf16 where supported), the rate of
activation-bound (element-wise) work, memory, versions.

Under a CPU quota (a container's or the testbed's cgroup: ``cpu.max`` in cgroup v2,
``cpu.cfs_quota_us`` in v1) the kernel lets a process run at full speed for its quota and then
stops it until the next period (100 ms by default). A 0.2 s benchmark spans two periods and reads
anywhere between the quota and full speed, so with a quota below the thread count the CPU
benchmark runs over at least ``QUOTA_PERIODS`` periods, and the planner sees the capped rate. Where
the cgroup files cannot be read (``ip netns exec`` mounts a fresh /sys, hiding /sys/fs/cgroup), the
throttling shows as a thread that got much less CPU time than wall time, which also lengthens it.
Where the rate is per second of the benchmark thread's own CPU time (one torch thread, the cgroup files
visible: :func:`measure_profile`), neither does: it runs for ``seconds`` of that CPU time, however long
the wall.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fusionp2p.errors import ConfigError
from fusionp2p.types import DeviceProfile

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

# torch is imported where a function needs it, not here: the node imports this module (check_device,
# check_slowdown) before it listens, and torch's import is most of a node's start-up (issue 40).

T = TypeVar("T")


def check_device(spec: str) -> None:
    """A ConfigError unless *spec* is a device :func:`parse_device` takes; plain ``cpu`` without importing torch."""
    if spec != "cpu":
        parse_device(spec)


def parse_device(spec: str) -> torch.device:
    """'cpu' or 'cuda:N'; ConfigError with what to do otherwise."""
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {spec!r}; use cpu or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build: install a CUDA one with `make clean setup "
                   "TORCH_INDEX=https://download.pytorch.org/whl/cu128` (README.md, \"Run a node\")"
                   if torch.version.cuda is None else "torch sees no CUDA device (check the driver and nvidia-smi)")
            raise ConfigError(f"device {spec} requested but CUDA is not available here: {why}; or use --device cpu")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"device {spec} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"unsupported device {spec!r}; use cpu or cuda:N")
    return dev


def _rate(work: Callable[[], object], per_call: float, dev: torch.device, seconds: float,
          stalled_seconds: float, *, cpu_clock: bool = False) -> float:
    """*per_call* units per second of ``work()`` (called once to warm up) over at least *seconds* of wall
    time; over at least *stalled_seconds* when this thread got less than 2/3 of the wall time (a CPU quota
    or a busy machine: see the module docstring). With *cpu_clock*, per second of this thread's CPU time
    instead of wall time: the device's rate, whatever share of a core other processes left the benchmark;
    then over *seconds* of that CPU time, however long the wall: a stretched wall time reads nothing more
    there, and on a crowded machine (20 node processes starting on 2 cores) it cost each node up to
    *stalled_seconds* of CPU a rate where *seconds* measure it."""
    import torch

    def call() -> None:
        work()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    call()  # warm-up
    reps = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    while True:
        call()
        reps += 1
        wall = time.perf_counter() - t0
        if cpu_clock:
            if time.thread_time() - c0 >= seconds:
                break
        elif wall >= seconds and (wall >= stalled_seconds or time.thread_time() - c0 > STALLED * wall):
            break
    cpu = time.thread_time() - c0
    return per_call * reps / (cpu if cpu_clock and cpu > 0 else time.perf_counter() - t0)


def _matmul_rate(dev: torch.device, dtype: torch.dtype, seconds: float, n: int, *, stalled_seconds: float = 0.0,
                 cpu_clock: bool = False) -> float:
    """FLOP/s of n x n matmuls (:func:`_rate`)."""
    import torch

    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    return _rate(lambda: a @ b, 2.0 * n**3, dev, seconds, stalled_seconds, cpu_clock=cpu_clock)


def _act_rate(dev: torch.device, seconds: float, *, stalled_seconds: float = 0.0, rows: int = 512,
              width: int = 64, cpu_clock: bool = False) -> float:
    """Bytes/s of activation-bound work (:func:`_rate`): a chain of element-wise ops as a transformer
    block has them (layer norm, GELU, scaled softmax, products and a residual add on a ``rows x width``
    fp32 tensor), forward and backward; the bytes are the forward outputs, which is how the workload
    counts a unit's ``act_bytes`` (graph/workload.py). On a CPU thread these ops run at a few GB/s,
    dispatch included, not at matmul speed: for small models they take most of a step
    (plan/estimator.py). A GPU needs millions of elements an op before launches stop dominating:
    :func:`measure_profile` passes ``ACT_SHAPE_CUDA`` there."""
    import torch

    x = torch.randn(rows, width, device=dev, requires_grad=True)
    shape = (-1, width, width) if rows % width == 0 else (1, rows, width)

    def once() -> None:
        h = torch.nn.functional.layer_norm(x, (width,))
        g = torch.nn.functional.gelu(h)
        a = torch.softmax(g.view(shape) * 0.125, dim=-1)
        torch.autograd.backward((a * g.view(shape) + h.view(shape)).sum())

    # outputs of layer_norm, gelu, mul, softmax, mul, add
    return _rate(once, 6 * rows * width * 4, dev, seconds, stalled_seconds, cpu_clock=cpu_clock)


# the element-wise benchmark's tensor on a GPU: 8,192 x 1,024 fp32 (32 MiB an op), the activations of a
# GPT-2 small block at 8 sequences of 1,024 tokens; launch overhead is then a small part of each op
ACT_SHAPE_CUDA = (8192, 1024)
QUOTA_PERIODS = 10
WALL_SECONDS = 0.2       # each rate of measure_profile over this much wall time ...
# ... or this much of the benchmark thread's CPU time: the fp32, element-wise and bf16 rates read the same
# at 0.1 as at 0.2 (within the +-5% between runs at either; 2026-11-30, load 28), and each node of a swarm
# starting together pays it (0.26 CPU-s where 0.2 took 0.52)
CPU_SECONDS = 0.1
STALLED = 2 / 3          # this thread's CPU time / wall time below which the benchmark runs longer
_CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
_CGROUP_V1_CPU = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"))


def cpu_quota(cgroup_text: str, read: Callable[[Path], str | None]) -> tuple[float, float] | None:
    """(cores, period seconds) of the tightest CPU quota on this process's cgroup path and its
    ancestors, from ``/proc/self/cgroup`` text and a file reader (None: no quota found)."""
    best: tuple[float, float] | None = None

    def consider(quota_us: float, period_us: float) -> None:
        nonlocal best
        if quota_us > 0 and period_us > 0 and (best is None or quota_us / period_us < best[0]):
            best = (quota_us / period_us, period_us / 1e6)

    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = Path(path.lstrip("/"))
        chain = [rel, *rel.parents] if str(rel) not in ("", ".") else [Path()]
        if controllers == "":       # cgroup v2
            for root in _CGROUP_ROOTS:
                for p in chain:
                    text = read(root / p / "cpu.max")
                    fields = text.split() if text else []
                    if len(fields) == 2 and fields[0] != "max":
                        try:
                            consider(float(fields[0]), float(fields[1]))
                        except ValueError:
                            continue
        elif "cpu" in controllers.split(","):
            for root in _CGROUP_V1_CPU:
                for p in chain:
                    q, per = read(root / p / "cpu.cfs_quota_us"), read(root / p / "cpu.cfs_period_us")
                    try:
                        consider(float(q or -1), float(per or -1))
                    except ValueError:
                        continue
    return best


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroups_visible() -> bool:
    """Whether this process sees the cgroup files a CPU quota would be in (``ip netns exec`` mounts a fresh
    /sys without them): then :func:`own_cpu_quota`'s None means no quota, not an unknown one."""
    return (any((r / "cgroup.controllers").exists() or (r / "cpu.max").exists() for r in _CGROUP_ROOTS)
            or any((r / "cpu.cfs_quota_us").exists() for r in _CGROUP_V1_CPU))


def own_cpu_quota() -> tuple[float, float] | None:
    """This process's CPU quota (cores, period seconds), or None (none, or not Linux)."""
    text = _read(Path("/proc/self/cgroup"))
    return cpu_quota(text, _read) if text else None


def host_identity(read: Callable[[Path], str | None] = _read) -> str:
    """What this node announces as its host (``DeviceProfile.host``): 16 hex digits of a hash of the
    machine id, the boot id and the network namespace, so that nodes of one machine (``make demo``'s, or
    several started by hand) name the same host, and the testbed's namespaces, each with a CPU share of
    its own, name different ones. A hash, not the ids: the machine id stays private, and the value
    changes at every boot, so it links a node's identities within one boot at most. "" where none of the
    ids can be read (then the planner assumes the node has its host to itself)."""
    ids = [(read(Path(p)) or "").strip() for p in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id")]
    if not any(ids):
        return ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return hashlib.sha256("\0".join(["fusionp2p host v1", *ids, netns]).encode()).hexdigest()[:16]


def host_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a CPU quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = own_cpu_quota()
    return max(1, min(n, math.ceil(quota[0]))) if quota is not None else max(1, n)


def check_slowdown(factor: float) -> None:
    """A ConfigError unless *factor* is a compute slowdown a node may emulate (``--emulate-slowdown``:
    ``DeviceProfile.slowed`` and the stage workers' sleeps; 1 = full speed)."""
    if not 1.0 <= factor <= 1000.0:
        raise ConfigError("--emulate-slowdown must be in 1..1000 (1 = full speed)")


def slowed(fn: Callable[..., T], factor: float, cpus: float | None) -> Callable[..., T]:
    """*fn*, then a sleep in its thread, so that it lasts *factor* times what it takes at the host's CPU
    share: its CPU time over *cpus*, or its wall time if that is longer (*cpus* None: its wall time).
    (The wall time alone is not it: under a CFS quota a short op that sleeps after itself never spends its
    quota, runs at full speed, and a slowdown of 2 at half a core would read as none.) The CPU time is
    the calling thread's: exact with one torch thread, as the testbed's hosts run. *fn* itself at 1."""
    if factor == 1.0:
        return fn

    def run(*args: Any, **kw: Any) -> T:
        t, c = time.perf_counter(), time.thread_time()
        out = fn(*args, **kw)
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        at_share = max(wall, cpu / cpus) if cpus else wall
        time.sleep(max(0.0, factor * at_share - wall))
        return out
    return run


MEMORY_HEADROOM = 0.10             # of the memory measured as available, left to the OS and the node itself
MEMORY_HEADROOM_MIN = 512 << 20    # ... and at least this much (Python, torch, libp2p and the content store)


_RESIDENT = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB", re.MULTILINE)


def resident() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (``/proc/self/status``); (0, 0) where there is none."""
    try:
        with open("/proc/self/status") as f:
            got = {k: int(v) * 1024 for k, v in _RESIDENT.findall(f.read())}
    except OSError:
        return 0, 0
    return got.get("VmRSS", 0), got.get("VmHWM", 0)


# What a node's process holds beside its stage while it trains one, over its resident size at start (after
# its device benchmark): the job's DAG, data and manifest, torch's autograd and allocator pools, the data
# plane's message buffers, a weight piece in flight. Measured (benchmarks/model_scale.py, 2026-11-29): 100-150
# MiB on four Llama stages of 112-169 MiB (29M parameters, 4 CLI nodes), about 80 of it from the job's intake.
NODE_RESERVE = 160 << 20


def stage_memory_of(offer: int, resident: int) -> int:
    """What a node whose process may use *offer* bytes in all (``--memory``) and holds *resident* bytes now
    offers to a job's stage: the rest less :data:`NODE_RESERVE`. ConfigError, saying what to do, when
    nothing is left."""
    left = offer - resident - NODE_RESERVE
    if left < (16 << 20):
        raise ConfigError(f"--memory {offer / 2**20:.0f}MiB leaves no room for a stage: this node's process holds "
                          f"{resident / 2**20:.0f} MiB and keeps {NODE_RESERVE >> 20} MiB for a job's own data; "
                          f"give at least --memory {(resident + NODE_RESERVE) / 2**20 + 64:.0f}MiB")
    log.info("--memory %.0f MiB: %.0f MiB for a stage (this process holds %.0f MiB, keeps %d MiB for a job's own data)",
             offer / 2**20, left / 2**20, resident / 2**20, NODE_RESERVE >> 20)
    return left


def offered_memory(available: int) -> int:
    """The memory a node offers by default: what it measured as available less the headroom
    (``MEMORY_HEADROOM`` of it, at least ``MEMORY_HEADROOM_MIN``), never under half of it."""
    return max(available // 2, available - max(int(available * MEMORY_HEADROOM), MEMORY_HEADROOM_MIN))


def enable_tf32(device: str) -> None:
    """On a CUDA node, let fp32 matmuls and convolutions use TF32 tensor cores (Ampere and later; 10 bits
    of mantissa in the products, fp32 accumulation, the trade every GPU training stack makes). A process
    setting: the node's daemon calls it once, before it measures the device."""
    if not device.startswith("cuda"):
        return   # plain cpu: no torch import needed
    import torch

    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def measure_profile(device: str = "cpu", *, seconds: float | None = None) -> DeviceProfile:
    """A short benchmark of the device (blocking: call it in a worker thread), each rate over *seconds*
    (default ``WALL_SECONDS``; on a CPU thread's own clock ``CPU_SECONDS``). Its ``memory_bytes`` is
    what the node offers by default: the available memory less the headroom (:func:`offered_memory`)."""
    import torch

    dev = parse_device(device)
    n = 512 if dev.type == "cpu" else 4096
    stalled, cap, cpu_clock, quota = 0.0, 1.0, False, None
    if dev.type == "cpu":
        quota = own_cpu_quota()
        # the cgroup files may be out of sight (``ip netns exec`` mounts its own /sys): a thread that
        # got much less CPU than wall time is throttled or crowded, and is measured over 10 periods
        stalled = QUOTA_PERIODS * 0.1
        # one torch thread where the quota is known (or known to be none): the rate per second of the
        # benchmark's own CPU time, capped by the quota. The wall-time rate read the machine's load at the
        # start-up instead: 4 demo nodes benchmarking and importing at once on 2 cores got 20-40% of a core
        # each, and announced 8-40 GFLOP/s where the core does 100-108 (2026-11-30, load 10-27), different
        # on every node and run; the cores the nodes of one host share are the planner's to count
        # (plan/predict.py host_shares). Threads beyond the first run outside this thread's clock.
        if torch.get_num_threads() == 1 and cgroups_visible():
            cpu_clock, cap = True, min(1.0, quota[0]) if quota is not None else 1.0
    seconds = seconds if seconds is not None else CPU_SECONDS if cpu_clock else WALL_SECONDS
    if dev.type == "cpu" and not cpu_clock and quota is not None and quota[0] < torch.get_num_threads():
        seconds = max(seconds, QUOTA_PERIODS * quota[1])   # wall-clock rates: see the module docstring
    fp32 = _matmul_rate(dev, torch.float32, seconds, n, stalled_seconds=stalled, cpu_clock=cpu_clock) * cap
    if dev.type == "cpu":
        act = _act_rate(dev, seconds, stalled_seconds=stalled, cpu_clock=cpu_clock) * cap
    else:
        act = _act_rate(dev, seconds, rows=ACT_SHAPE_CUDA[0], width=ACT_SHAPE_CUDA[1])
    try:
        bf16 = _matmul_rate(dev, torch.bfloat16, seconds / 2, n, cpu_clock=cpu_clock) * cap
    except RuntimeError:
        bf16 = 0.0
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        mem, name = int(free), torch.cuda.get_device_name(dev)
    else:
        mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
        name = f"{platform.machine()} ({torch.get_num_threads()} threads)"
    versions = (("python", platform.python_version()), ("torch", torch.__version__))
    # CPU nodes say which host they run on: the planner shares its cores among those it puts there
    host = host_identity() if dev.type == "cpu" else ""
    return DeviceProfile(device=str(dev), kind=dev.type, name=name, flops_fp32=fp32, flops_bf16=bf16,
                         act_rate=act, memory_bytes=offered_memory(mem), threads=torch.get_num_threads(),
                         versions=versions, host=host, host_cpus=host_cpus() if host else 0)
