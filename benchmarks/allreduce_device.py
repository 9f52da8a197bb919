"""``benchmarks/allreduce.py --device gpu``: sdp's allreduce on device (CuPy) arrays.

Run under the launcher on a machine with a GPU, PyCUDA and CuPy (every rank on the one GPU, or one
GPU per local rank when there are several; with several ranks on one GPU, start NVIDIA's MPS
daemon first, ``nvidia-cuda-mps-control -d``, as ``tests/gpu_run.sh`` does: without it the GPU
time-slices between the processes and every synchronisation waits ~130 us for a context switch)::

    sdprun -np 2 python benchmarks/allreduce.py --device gpu
    sdprun -np 4 python benchmarks/allreduce.py --device gpu --sizes 1K,1M,64M

Prints (rank 0), per message size, the SUM allreduce of a float32 CuPy array: median time and busbw
(algbw * 2(n-1)/n, GB/s = 1e9 B/s) on the CUDA IPC path, on the host-staged path (the same job
switched to it), and of a numpy array of the same size on the CPU path; then the 1 KB latency and
a fused list of 100 x 256 KB on the IPC path; the IPC path twice: as it runs (the fast lane takes a
synchronous allreduce of every rank into the calling thread) and through the engine thread (the
lane set aside, ``ipc engine``); then the ceilings measured in the same run:
device-to-device copy bandwidth (bytes read + written per second) and page-locked
device-to-host / host-to-device bandwidth; and PASS/FAIL against the targets below.
"""
import statistics
import time

import numpy as np

import sdp

TARGET_PINNED_GBPS = 40.0      # pinned D2H and H2D
TARGET_IPC_64M_BUSBW = 150.0   # GB/s, 2 ranks, float32
TARGET_STAGED_VS_HOST = 0.9    # staged busbw / CPU path busbw at 64 MB
TARGET_FUSED_MS = 1.0          # 100 x 256 KB, one grouped allreduce
TARGET_1K_MS = 0.5


def _median_time(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return float(max(sdp.allgather(np.array([med]), name="bench.max")))  # the slowest rank's median


def _iters_for(nbytes, path="host"):
    """Timed iterations: ~0.1-0.5 s per size (the IPC path is ~20x faster than the others)."""
    if path == "ipc":
        return 200 if nbytes <= 16 << 20 else 100
    return 200 if nbytes <= 1 << 20 else (40 if nbytes <= 16 << 20 else 12)


def _ceilings(cp, nbytes=256 << 20):
    """Device-to-device copy (CuPy; bytes read + written per second) and page-locked D2H / H2D
    (PyCUDA ``pagelocked_empty`` + ``memcpy_dtoh``/``memcpy_htod``), GB/s, median of 5."""
    import pycuda.driver as cuda
    cuda.init()
    ctx = cuda.Device(cp.cuda.Device().id).retain_primary_context()
    ctx.push()
    try:
        return _copy_rates(cp, cuda, nbytes)
    finally:
        cuda.Context.pop()


def _copy_rates(cp, cuda, nbytes):
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    host = cuda.pagelocked_empty(nbytes, np.uint8)

    def timed(f, reps=5):
        f()
        cp.cuda.Device().synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            cp.cuda.Device().synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    d2d = 2 * nbytes / timed(lambda: dst.__setitem__(Ellipsis, src)) / 1e9
    d2h = nbytes / timed(lambda: cuda.memcpy_dtoh(host, src.data.ptr)) / 1e9
    h2d = nbytes / timed(lambda: cuda.memcpy_htod(dst.data.ptr, host)) / 1e9
    return d2d, d2h, h2d


def main(args, sizes) -> int:
    import cupy as cp
    sdp.init()
    n, rank = sdp.size(), sdp.rank()
    cp.cuda.Device(sdp.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
    factor = 2 * (n - 1) / n if n > 1 else 1.0

    def log0(*a):
        if rank == 0:
            print(*a, flush=True)

    log0(f"# sdp device allreduce: {n} ranks, device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
         f"float32 SUM, busbw = algbw*2(n-1)/n")
    rows, lat, fused = {}, {}, {}
    lane = sdp.api.runtime().lane  # (None: ranks on several hosts, or SDP_FAST_LANE=0)
    for path in ("ipc", "engine", "staged"):
        sdp.barrier()
        if path == "engine":  # the IPC path through the engine thread: the same job, the lane set aside
            if lane is None:
                continue
            lane.enabled = False
        if path == "staged":  # the same job, switched to host staging on every rank at once
            if lane is not None:
                lane.enabled = True
            dp = sdp.api.runtime()._device
            dp.ipc, dp._why_staged = False, "benchmark: staged path"
        for nbytes in sizes:
            x = cp.ones(nbytes // 4, cp.float32)
            t = _median_time(lambda: sdp.allreduce(x, op=sdp.Sum, name=f"d{nbytes}"),
                             _iters_for(nbytes, "host" if path == "staged" else "ipc"))
            rows.setdefault(nbytes, {})[path] = t
            if path == "ipc" and nbytes == sizes[-1]:
                ipc_counters = dict(sdp.device_counters())
        if path != "staged":
            lat[path] = _median_time(lambda: sdp.allreduce(cp.ones(256, cp.float32), op=sdp.Sum, name="lat"), 500, 20)
            grads = [cp.full(65536, i, cp.float32) for i in range(100)]
            fused[path] = _median_time(lambda: sdp.grouped_allreduce(grads, op=sdp.Sum, name="fused"), 50, 5)
    for nbytes in sizes:
        h = np.ones(nbytes // 4, np.float32)
        rows[nbytes]["host"] = _median_time(lambda: sdp.allreduce(h, op=sdp.Sum, name=f"h{nbytes}"),
                                            _iters_for(nbytes))
    sdp.barrier()
    d2d, d2h, h2d = _ceilings(cp) if rank == 0 else (0.0, 0.0, 0.0)  # alone: the copies share the link
    sdp.barrier()
    paths = [p for p in ("ipc", "engine", "staged", "host") if p in rows[sizes[0]]]
    heads = {"ipc": "ipc", "engine": "ipc engine", "staged": "staged", "host": "cpu"}
    log0(f"{'size':>8}" + "".join(f" {heads[p] + ' us':>14} {'busbw':>8}" for p in paths))
    for nbytes in sizes:
        r = rows[nbytes]
        log0(f"{_fmt(nbytes):>8}" + "".join(f" {r[p] * 1e6:14.1f} {nbytes / r[p] / 1e9 * factor:8.2f}" for p in paths))
    log0("(ipc: the fast lane runs each synchronous allreduce in the calling thread where it can; "
         "ipc engine: the same path through the engine thread, the lane set aside)")
    for path in lat:
        log0(f"1 KB latency ({heads[path]}): {lat[path] * 1e3:.3f} ms;  100 x 256 KB fused ({heads[path]}): "
             f"{fused[path] * 1e3:.3f} ms")
    lat, fused = lat["ipc"], fused["ipc"]
    log0(f"ceilings: device-to-device copy {d2d:.1f} GB/s (read+write), pinned D2H {d2h:.1f} GB/s, "
         f"pinned H2D {h2d:.1f} GB/s")
    log0(f"ipc path counters after the sizes: {ipc_counters}")
    if 64 << 20 in rows:
        r = rows[64 << 20]
        ipc_bw = (64 << 20) / r["ipc"] / 1e9 * factor
        ratio = r["host"] / r["staged"]
        log0(_verdict(f"64 MB ipc busbw >= {TARGET_IPC_64M_BUSBW} GB/s: {ipc_bw:.1f}", ipc_bw >= TARGET_IPC_64M_BUSBW, n))
        log0(_verdict(f"64 MB staged >= {TARGET_STAGED_VS_HOST}x cpu path: {ratio:.2f}x", ratio >= TARGET_STAGED_VS_HOST, n))
    log0(_verdict(f"pinned D2H and H2D >= {TARGET_PINNED_GBPS} GB/s: {d2h:.1f} / {h2d:.1f}",
                  min(d2h, h2d) >= TARGET_PINNED_GBPS))
    log0(_verdict(f"100 x 256 KB fused <= {TARGET_FUSED_MS} ms: {fused * 1e3:.3f}", fused * 1e3 <= TARGET_FUSED_MS, n))
    log0(_verdict(f"1 KB <= {TARGET_1K_MS} ms: {lat * 1e3:.3f}", lat * 1e3 <= TARGET_1K_MS, n))
    sdp.shutdown()
    return 0


def _fmt(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n // div}{unit}"
    return str(n)


def _verdict(text, ok, n=2):  # (n=2 for a target that does not depend on the ranks)
    note = "" if n == 2 else f" (for reference only: the targets are for 2 ranks, this run has {n})"
    return f"  {text}  {'PASS' if ok else 'FAIL'}{note}"
