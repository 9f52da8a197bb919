"""Allreduce benchmark for sdp, with a TensorFlow collective-ring baseline measured in the same run.

Run under the launcher::

    sdprun -np 2 python benchmarks/allreduce.py
    sdprun -np 4 python benchmarks/allreduce.py --baseline none

Prints (rank 0):

1. an environment line (cores, load, versions, world size, engine settings);
2. per message size: sdp ``allreduce`` (SUM) median time, algbw = bytes / time and
   busbw = algbw * 2(n-1)/n (the nccl-tests definitions, GB/s = 1e9 B/s), next to the same sizes
   for TensorFlow's ``MultiWorkerMirroredStrategy`` RING all-reduce (2 workers on 127.0.0.1,
   started by ranks 0 and 1 after sdp's measurements) and, when installed, Horovod;
3. the 1 KB latency (median and p90), and the latency section of ``latency.py``: the machine's
   wake-up floor (a pipe ping-pong round trip, RTT) measured in the same run, 1 KB / 64 KB back
   to back and isolated (after a barrier and 1 ms idle), a step of 100 cached 4 KB tensors, and
   issue 30's targets as multiples of the RTT (``--latency-only``: just this section);
4. a gradient list, 100 tensors of 256 KB: fused (one 25 MB bucket) vs unfused;
5. PASS/FAIL against the targets below (a miss does not fail the process);
6. when the ranks span several hosts: flat ring vs hierarchical allreduce busbw from 1 MB up, the
   raw TCP bandwidth between two hosts measured here, the busbw a perfect algorithm would
   reach on that link, and the hierarchical path's host-local work alone (``local(us)``)
   (``SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1 sdprun -np 4 -H a:2,b:2 ...`` fakes hosts).

With ``--api numpy,tf-eager,tf-function`` it prints instead the same allreduce through the engine
(``sdp.allreduce``), ``sdp.tensorflow.allreduce`` eagerly and inside a ``tf.function``, side by
side per size, with the TF face's targets and the measured floors (the engine's own time, the call of
a ``tf.function`` holding one ``numpy_function``, sdp's graph op where its compiled ``SdpCall`` is
not built (``SdpCall`` costs ~30 us less), and with ``tf-function`` a column
``floor``: a ``tf.function`` whose one ``numpy_function`` calls ``sdp.allreduce``, no sdp.tensorflow
code); a missed target is printed with the bound those floors put on any design of this kind.

Times are per-rank medians over the timed iterations, then the maximum over ranks.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import sdp
from sdp.common.config import Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latency  # noqa: E402  (benchmarks/latency.py, beside this script)
from sdpbench.apis import API_CHOICES, compare_apis  # noqa: E402  (benchmarks/sdpbench/: this script's sections)
from sdpbench.baselines import free_ports, horovod_status, run_tf_baseline  # noqa: E402
from sdpbench.common import (  # noqa: E402
    HERE, busbw_factor, log0, max_over_ranks, parse_size, plan_iters, summary_line)
from sdpbench.hosts import across_hosts, report_across_hosts  # noqa: E402
from sdpbench.measure import (  # noqa: E402
    GRAD_BYTES, GRAD_COUNT, GRAD_WARMUP, CopyTimer, Row, measure_grad_modes, time_allreduce, time_grad_list)

# ---- targets (issue 3, item 9); checked for 2 ranks, float32 -------------------------------------
TARGET_BUSBW_64M_GBPS = 1.5        # sdp busbw at 64 MB, 2 ranks, float32
TARGET_VS_TF_64M = 2.0             # sdp busbw / TF ring busbw at 64 MB, same run
TARGET_1K_MEDIAN_US = 1000.0       # 1 KB allreduce median latency
TARGET_FUSED_SPEEDUP = 5.0         # unfused / fused time for 100 x 256 KB

DEFAULT_SIZES = "1K,16K,256K,1M,4M,16M,64M,256M"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="sdp allreduce benchmark (run under sdprun)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=0,
                   help="timed iterations per size (default 0: as many as fit in --target-s)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up iterations per size")
    p.add_argument("--target-s", type=float, default=1.0, help="seconds per size when --iters is 0")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--baseline", choices=("tf", "none"), default="tf")
    p.add_argument("--baseline-timeout", type=float, default=600.0, help="seconds for the TF baseline")
    p.add_argument("--latency-iters", type=int, default=500, help="iterations of the 1 KB latency test")
    p.add_argument("--isolated-iters", type=int, default=200,
                   help="isolated collectives (each after a barrier and 1 ms idle) per size, latency section")
    p.add_argument("--breakdown", action="store_true",
                   help="with --latency-only: also where a 1 KB allreduce's time goes, phase by phase")
    p.add_argument("--latency-only", action="store_true",
                   help="only the latency section (floor, back to back, isolated, 100-tensor step; latency.py)")
    p.add_argument("--fused-table", dest="fused_table", action="store_true", default=True)
    p.add_argument("--no-fused-table", dest="fused_table", action="store_false")
    p.add_argument("--fused-iters", type=int, default=0, help="gradient lists timed per mode (0: auto)")
    p.add_argument("--link-seconds", type=float, default=2.0,
                   help="seconds of the raw TCP test between two hosts (ranks on several hosts only)")
    p.add_argument("--api", default="",
                   help=f"comma-separated APIs ({','.join(API_CHOICES)}): time the same allreduce through "
                        "each and print them side by side (default: the engine tables below)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: allreduce CuPy arrays on the device path (benchmarks/allreduce_device.py)")
    args = p.parse_args(argv)
    apis = [a.strip() for a in args.api.split(",") if a.strip()]
    if any(a not in API_CHOICES for a in apis):
        p.error(f"--api: expected some of {','.join(API_CHOICES)}, got {args.api!r}")

    dtype = np.dtype(args.dtype)
    sizes = sorted({max(dtype.itemsize, parse_size(s) // dtype.itemsize * dtype.itemsize)
                    for s in args.sizes.split(",") if s.strip()})
    if args.device == "gpu":
        sys.path.insert(0, HERE)
        import allreduce_device
        return allreduce_device.main(args, sizes)
    if any(a.startswith("tf-") for a in apis):
        import sdp.tensorflow as sdp_tf  # (a plain `import sdp.tensorflow` would make `sdp` local to main)
        sdp_tf.init()  # as a TF user does (it also sets up TensorFlow's threads for sdp)
    else:
        sdp.init()
    n, rank = sdp.size(), sdp.rank()
    log0(summary_line(n, args.dtype))
    if apis:
        return compare_apis(args, apis, sizes, dtype)
    t_start = time.perf_counter()
    if args.latency_only:
        res = latency.measure(args.latency_iters, args.isolated_iters)
        for line in latency.report(res):
            log0(line)
        if args.breakdown:
            for idle in (False, True):
                for line in latency.breakdown(args.isolated_iters, idle):
                    log0(line)
        log0(f"total {time.perf_counter() - t_start:.1f} s; load at end "
             f"[{' '.join(f'{x:.2f}' for x in os.getloadavg())}]")
        sdp.shutdown()
        return 0

    # 1. sizes ---------------------------------------------------------------------------------
    rows = []
    for nbytes in sizes:
        buf = np.ones(nbytes // dtype.itemsize, dtype)
        times = time_allreduce(buf, args.iters, args.warmup, args.target_s)
        t = max_over_ranks(statistics.median(times), "bench.median")
        rows.append(Row(nbytes, buf.size, len(times), t))
        log0(f"sdp {nbytes:>11d} B  median {t * 1e6:12.1f} us  ({len(times)} iters)")
        del buf

    hosts_table = across_hosts(args, sizes, dtype)  # None on one host

    # 2. 1 KB latency --------------------------------------------------------------------------
    buf = np.ones(max(1, 1024 // dtype.itemsize), dtype)
    lat = time_allreduce(buf, max(200, args.latency_iters), max(args.warmup, 20), args.target_s,
                         name="latency")
    lat_med = max_over_ranks(statistics.median(lat), "lat.median")
    lat_p90 = max_over_ranks(float(np.percentile(lat, 90)), "lat.p90")
    lat_min = max_over_ranks(min(lat), "lat.min")
    lat_floor = latency.measure(args.latency_iters, args.isolated_iters)  # against the machine's floor

    # 3. gradient list: fused vs unfused --------------------------------------------------------
    fused, floor = None, None
    if args.fused_table:  # (the engine's fusion: with the fast lane set aside, see latency.lane_off)
        with latency.lane_off():
            grads = [np.full(GRAD_BYTES // 4, i, np.float32) for i in range(GRAD_COUNT)]
            time_grad_list(grads, "async", GRAD_WARMUP)  # warm up (response cache, result pool pages)
            est, _ = time_grad_list(grads, "async", 1)
            iters = args.fused_iters or plan_iters(max_over_ranks(est[0], "fused.plan"), 2.0, 5, 50)
            copier = None
            if Config.from_env().shm_slab_bytes >= GRAD_COUNT * GRAD_BYTES and sdp.local_size() == n > 1:
                copier = CopyTimer(GRAD_COUNT * GRAD_BYTES, n)  # the memory floor, measured between the modes
            times = measure_grad_modes(grads, iters, hasattr(sdp.api, "grouped_allreduce_async"), copier=copier)
            f_t, f_c = times["async"]
            g_t, g_c = times.get("grouped", (None, None))
            s_t, s_c = times["sequential"]
            u_t, u_c = times["unfused"]
            fused = {k: (max_over_ranks(statistics.median(v), f"gl.{k}"), int(statistics.median(c)), len(v))
                     for k, v, c in (("fused", f_t, f_c), ("grouped", g_t, g_c), ("unfused", u_t, u_c),
                                     ("sequential", s_t, s_c)) if v}
            if copier is not None:
                copy_s = max_over_ranks(statistics.median(times["copy"][0]), "floor.copy")
                floor = (copy_s * copier.copies_per_allreduce, copy_s)
            del grads, copier

    # 4. baselines (sdp's work is done: the TF workers get both cores) ---------------------------
    tf_note = "tf: not measured (--baseline none)"
    if args.baseline == "tf" and n >= 2:
        info = None
        if rank == 0:
            info = {"dir": tempfile.mkdtemp(prefix="sdp-bench-tf-"), "ports": free_ports(2)}
        info = sdp.broadcast_object(info, 0, name="tf.info")
        info["rank"] = rank
        sdp.shutdown()
        if rank < 2:
            if rank == 0:
                print(f"running the TensorFlow baseline (2 workers on 127.0.0.1:{info['ports']}) ...",
                      flush=True)
            med, tf_note = run_tf_baseline(args, sizes, info)
            if rank == 0:
                if med:
                    for row in rows:
                        row.tf_t = med.get(row.nbytes)
                shutil.rmtree(info["dir"], ignore_errors=True)
    elif args.baseline == "tf":
        tf_note = "tf: not measured (world size 1)"
    hvd_note = horovod_status()
    if rank != 0:
        sdp.shutdown()
        return 0

    # 5. report ----------------------------------------------------------------------------------
    bf = busbw_factor(n)
    print("", flush=True)
    print(f"allreduce (SUM, {args.dtype}), {n} ranks, into a preallocated output; time = median over "
          f"iterations, max over ranks; busbw = algbw*2(n-1)/n; GB/s = 1e9 B/s", flush=True)
    print(f"baseline: {tf_note.splitlines()[0] if tf_note else ''}; {hvd_note}", flush=True)
    if tf_note and "failed" in tf_note:
        print(tf_note, flush=True)
    hdr = (f"{'size(B)':>10} {'count':>10} {'iters':>6} {'time_median(us)':>16} {'algbw(GB/s)':>12} "
           f"{'busbw(GB/s)':>12} | {'tf2w_time(us)':>14} {'tf_algbw':>9} {'tf_busbw':>9} | "
           f"{'busbw/tf':>8}")
    print(hdr, flush=True)
    print("-" * len(hdr), flush=True)
    for row in rows:
        alg = row.nbytes / row.t / 1e9
        bus = alg * bf
        if row.tf_t:
            tf_alg = row.nbytes / row.tf_t / 1e9
            tf_bus = tf_alg * busbw_factor(2)
            tfc = f"{row.tf_t * 1e6:14.1f} {tf_alg:9.3f} {tf_bus:9.3f}"
            ratio = f"{bus / tf_bus:8.2f}" if tf_bus > 0 else f"{'n/a':>8}"
        else:
            tfc, ratio = f"{'n/a':>14} {'n/a':>9} {'n/a':>9}", f"{'n/a':>8}"
        print(f"{row.nbytes:>10d} {row.count:>10d} {row.iters:>6d} {row.t * 1e6:16.1f} {alg:12.3f} "
              f"{bus:12.3f} | {tfc} | {ratio}", flush=True)

    if hosts_table:
        report_across_hosts(*hosts_table, n)
    print("", flush=True)
    print(f"1 KB latency ({len(lat)} iters): median {lat_med * 1e6:.1f} us, p90 {lat_p90 * 1e6:.1f} us, "
          f"min {lat_min * 1e6:.1f} us (max over ranks)", flush=True)
    for line in latency.report(lat_floor):
        print(line, flush=True)

    if fused:
        print("", flush=True)
        print(f"gradient list: {GRAD_COUNT} tensors x {GRAD_BYTES // 1024} KB float32 "
              f"({GRAD_COUNT * GRAD_BYTES / 2**20:.0f} MB), {n} ranks, the engine (fast lane set aside)", flush=True)
        h2 = f"{'mode':<46} {'iters':>5} {'time/list(ms)':>14} {'collectives':>11} {'busbw(GB/s)':>12} {'vs fused':>9}"
        print(h2, flush=True)
        print("-" * len(h2), flush=True)
        base = fused["fused"][0]
        labels = {"fused": "fused: 100 x allreduce_async, wait all",
                  "grouped": "fused: grouped_allreduce_async (1 batch)",
                  "unfused": "unfused: allreduce_async, fusion threshold 0",
                  "sequential": "unfused+unpipelined: allreduce, one by one"}
        for k in [k for k in labels if k in fused]:
            t, c, it = fused[k]
            bus = GRAD_COUNT * GRAD_BYTES / t / 1e9 * bf
            print(f"{labels[k]:<46} {it:>5d} {t * 1e3:14.2f} {c:>11d} {bus:12.3f} {t / base:8.2f}x", flush=True)
        if floor:
            # unfused does the same memory traffic plus a fixed cost per collective, so with a fused
            # list at the floor, unfused / fused can be at most (floor + count * cost) / floor
            per = (fused["unfused"][0] - base) / (GRAD_COUNT - 1)
            print(f"memory floor (shared memory, {n} ranks): {floor[0] * 1e3:.2f} ms = "
                  f"{1 + (n - 1) / n:.2f} x {floor[1] * 1e3:.2f} ms (every rank copying "
                  f"{GRAD_COUNT * GRAD_BYTES / 2**20:.0f} MB at once, "
                  f"{2 * GRAD_COUNT * GRAD_BYTES / floor[1] / 1e9:.1f} GB/s read+write per rank); "
                  f"fused = {base / floor[0]:.2f}x the floor; unfused costs {per * 1e6:.1f} us more "
                  f"per collective, so unfused/fused <= {(floor[0] + GRAD_COUNT * per) / floor[0]:.2f}x "
                  f"even with a fused list at the floor", flush=True)

    # 6. targets ---------------------------------------------------------------------------------
    print("", flush=True)
    print("targets (2 ranks, float32):", flush=True)
    applicable = n == 2 and args.dtype == "float32"

    def verdict(ok):
        if not applicable:
            return f"n/a ({n} ranks, {args.dtype}: the targets are for 2 ranks, float32)"
        return "PASS" if ok else "FAIL"

    r64 = next((r for r in rows if r.nbytes == 64 << 20), None)
    if r64 and applicable:
        bus = r64.nbytes / r64.t / 1e9 * bf
        print(f"  busbw @64MB >= {TARGET_BUSBW_64M_GBPS} GB/s: {bus:.3f} GB/s  "
              f"{verdict(bus >= TARGET_BUSBW_64M_GBPS)}", flush=True)
        if r64.tf_t:
            ratio = r64.tf_t / r64.t
            print(f"  >= {TARGET_VS_TF_64M}x TF ring @64MB: {ratio:.2f}x  {verdict(ratio >= TARGET_VS_TF_64M)}",
                  flush=True)
        else:
            print(f"  >= {TARGET_VS_TF_64M}x TF ring @64MB: SKIP (TF baseline not measured)", flush=True)
    else:
        print("  busbw @64MB / vs TF: SKIP (needs 64M in --sizes, 2 ranks, float32)", flush=True)
    print(f"  1 KB median <= {TARGET_1K_MEDIAN_US:.0f} us: {lat_med * 1e6:.1f} us  "
          f"{verdict(lat_med * 1e6 <= TARGET_1K_MEDIAN_US)}",
          flush=True)
    if fused:
        sp = fused["unfused"][0] / fused["fused"][0]
        print(f"  fused 100x256KB >= {TARGET_FUSED_SPEEDUP}x faster than unfused: {sp:.2f}x  "
              f"{verdict(sp >= TARGET_FUSED_SPEEDUP)} (fused = allreduce_async x100; "
              + (f"grouped: {fused['unfused'][0] / fused['grouped'][0]:.2f}x; " if "grouped" in fused else "")
              + f"fused vs unfused+unpipelined: {fused['sequential'][0] / fused['fused'][0]:.2f}x)",
              flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"total {time.perf_counter() - t_start:.1f} s; load at end [{load}]", flush=True)
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
