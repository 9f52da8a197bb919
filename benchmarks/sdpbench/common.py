"""What every section of ``benchmarks/allreduce.py`` uses (and ``torch_allreduce.py``, ``p2p.py``,
``overlap.py``, ``tf_overlap.py`` with it): message sizes and their names, the busbw factor,
printing on rank 0, the max over ranks, iteration planning, the timing loop of every table and
the environment line that heads a run."""
import os
import platform
import statistics
import time

import numpy as np

import sdp
from sdp.common.config import Config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def parse_size(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '1G', or plain bytes."""
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def busbw_factor(n: int) -> float:
    return 2.0 * (n - 1) / n


def log0(*args) -> None:
    if sdp.rank() == 0:
        print(*args, flush=True)


def max_over_ranks(x: float, name: str) -> float:
    return float(sdp.allreduce(np.array([x], np.float64), name=name, op=sdp.Max)[0])


def plan_iters(est_s: float, target_s: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, round(target_s / max(est_s, 1e-7)))))


def collectives_done() -> int:
    """Collectives this rank's engine has run so far (a private counter; -1 if unavailable)."""
    return getattr(sdp.api.runtime(), "_seq", -1)


def median_call_time(call, iters: int, warmup: int = 2) -> float:
    """Median seconds of ``iters`` calls of ``call`` after ``warmup`` untimed ones (this rank's)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_calls(call, iters: int, warmup: int, target_s: float, name: str):
    """Per-iteration wall times of ``call()`` on this rank (iteration count planned from the
    slowest rank's last warm-up iteration, as :func:`time_allreduce`)."""
    last = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        call()
        last = time.perf_counter() - t0
    if not iters:
        iters = plan_iters(max_over_ranks(last, f"{name}.plan"), target_s, 5, 2000)
    times = []
    sdp.barrier()
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def summary_line(n: int, dtype: str) -> str:
    import zmq
    cfg = Config.from_env()
    try:
        aff = len(os.sched_getaffinity(0))
    except AttributeError:
        aff = os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"env: host={platform.node()} cores={os.cpu_count()} (affinity {aff}) load=[{load}] "
            f"python={platform.python_version()} numpy={np.__version__} pyzmq={zmq.pyzmq_version()} "
            f"libzmq={zmq.zmq_version()} sdp={sdp.__version__} world_size={n} dtype={dtype} "
            f"fusion={cfg.fusion_threshold}B cycle={cfg.cycle_time_ms}ms segment={cfg.segment_bytes}B "
            f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}")
