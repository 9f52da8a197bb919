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
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import sdp
from sdp.common.config import Config
from sdp.launcher.cli import STREAMING_COPIES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latency  # noqa: E402  (benchmarks/latency.py, beside this script)

# ---- targets (issue 3, item 9); checked for 2 ranks, float32 -------------------------------------
TARGET_BUSBW_64M_GBPS = 1.5        # sdp busbw at 64 MB, 2 ranks, float32
TARGET_VS_TF_64M = 2.0             # sdp busbw / TF ring busbw at 64 MB, same run
TARGET_1K_MEDIAN_US = 1000.0       # 1 KB allreduce median latency
TARGET_FUSED_SPEEDUP = 5.0         # unfused / fused time for 100 x 256 KB

DEFAULT_SIZES = "1K,16K,256K,1M,4M,16M,64M,256M"
GRAD_COUNT, GRAD_BYTES = 100, 256 * 1024
GRAD_WARMUP = 10  # untimed gradient lists before the gradient-list table (the first 5-10 fused lists ran ~15% slower)
GRAD_ROUNDS = 5  # the gradient-list modes run interleaved, in this many rounds
GRAD_WARMUP_SWITCH = 3  # untimed lists after each switch of mode
HERE = os.path.dirname(os.path.abspath(__file__))


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


# ---- sdp measurements ------------------------------------------------------------------------------
def time_allreduce(buf: np.ndarray, iters: int, warmup: int, target_s: float, name: str = "bench"):
    """Per-iteration wall times of ``sdp.allreduce(buf, SUM, out=preallocated)`` on this rank (same
    iteration count on every rank: planned from the slowest rank's last warm-up iteration).  The
    result goes into a preallocated array, as nccl-tests does, so the figure is the collective and
    not the page faults of a fresh 64 MB allocation (glibc maps every array > 32 MB anew)."""
    out = np.empty_like(buf)
    return time_calls(lambda: sdp.allreduce(buf, name=name, op=sdp.Sum, out=out), iters, warmup, target_s, name)


def time_grad_list(grads, mode: str, iters: int):
    """Time one gradient list: 'async' submits all (one ``allreduce_async`` each) then waits all;
    'grouped' submits all in one batch (``grouped_allreduce_async``); 'sequential' waits each."""
    times = []
    colls = []
    sdp.barrier()
    for _ in range(iters):
        c0 = collectives_done()
        t0 = time.perf_counter()
        if mode == "async":
            hs = [sdp.allreduce_async(g, name=f"grad.{i}", op=sdp.Sum) for i, g in enumerate(grads)]
            for h in hs:
                h.wait()
        elif mode == "grouped":
            hs = sdp.api.grouped_allreduce_async(grads, names=[f"grad.{i}" for i in range(len(grads))],
                                             op=sdp.Sum)
            for h in hs:
                h.wait()
        else:
            for i, g in enumerate(grads):
                sdp.allreduce(g, name=f"grad.{i}", op=sdp.Sum)
        times.append(time.perf_counter() - t0)
        colls.append(collectives_done() - c0)
    return times, colls


def measure_grad_modes(grads, iters: int, grouped: bool, rounds: int = GRAD_ROUNDS, copier=None):
    """Times of every gradient-list mode, interleaved: ``rounds`` rounds, each running every mode
    in turn (``iters / rounds`` lists of the fused modes, a third of that of the slow unfused
    ones, each after :data:`GRAD_WARMUP_SWITCH` untimed lists), so that a slow stretch of the
    machine hits every mode alike instead of one block.  Unfused = fusion threshold 0, set with
    ``set_fusion_threshold`` (rank 0's value plans every rank's buckets).  Returns
    ``{mode: (times, collectives per list)}``; modes: async, grouped, sequential, unfused, and
    "copy" (``copier.time_copy()`` once per round, when a :class:`CopyTimer` is given)."""
    threshold = sdp.api.fusion_threshold()
    modes = [("async", "async", threshold, 1), ("sequential", "sequential", threshold, 3),
             ("unfused", "async", 0, 3)]
    if grouped:
        modes.insert(1, ("grouped", "grouped", threshold, 1))
    per_round = max(1, -(-iters // rounds))
    out = {key: ([], []) for key, *_ in modes}
    for _ in range(rounds):
        for key, mode, fusion, div in modes:
            sdp.api.set_fusion_threshold(fusion)
            time_grad_list(grads, mode, GRAD_WARMUP_SWITCH)
            t, c = time_grad_list(grads, mode, max(1, per_round // div))
            out[key][0].extend(t)
            out[key][1].extend(c)
        if copier is not None:
            out.setdefault("copy", ([], []))[0].append(copier.time_copy())
    sdp.api.set_fusion_threshold(threshold)
    return out


class CopyTimer:
    """The memory floor of a shared-memory allreduce of ``nbytes``: :meth:`time_copy` times one
    ``np.copyto`` of ``nbytes`` out of cache while every rank copies at the same time (``copies``
    back to back after a barrier, alternating between two source/destination pairs that together
    exceed any cache).  Per rank the shared-memory path reads and writes ``2 * nbytes * (n-1)/n``
    packing the peers' chunks and ``2 * nbytes`` reducing its chunk and pushing it to every peer
    (see ``sdp.engine.collectives.allreduce_staged``): :attr:`copies_per_allreduce` =
    ``1 + (n-1)/n`` copies of ``nbytes``."""

    def __init__(self, nbytes: int, n: int, copies: int = 6):
        self.pairs = [(np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)) for _ in range(2)]
        for src, dst in self.pairs:
            np.copyto(dst, src)  # first touch, outside the timing
        self.copies, self.copies_per_allreduce = copies, 1 + (n - 1) / n

    def time_copy(self) -> float:
        sdp.barrier()
        t0 = time.perf_counter()
        for k in range(self.copies):
            np.copyto(self.pairs[k % 2][1], self.pairs[k % 2][0])
        return (time.perf_counter() - t0) / self.copies


@dataclasses.dataclass
class Row:
    nbytes: int
    count: int
    iters: int
    t: float            # median seconds, max over ranks
    tf_t: float = None  # TF baseline median (2 workers), max over workers
    hvd_t: float = None


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


# ---- baselines -------------------------------------------------------------------------------------
def free_ports(k: int):
    socks, ports = [], []
    for _ in range(k):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def run_tf_baseline(args, sizes, info):
    """On ranks 0 and 1 (sdp already shut down): run one TF worker each; rank 0 returns
    ({bytes: median_s}, note) with the max over both workers."""
    r = info["rank"]
    outdir, ports = info["dir"], info["ports"]
    cmd = [sys.executable, os.path.join(HERE, "_tf_baseline.py"), "--index", str(r),
           "--ports", ",".join(map(str, ports)), "--sizes", ",".join(map(str, sizes)),
           "--dtype", args.dtype, "--warmup", str(args.warmup), "--target-s", str(args.target_s),
           "--out", outdir]
    if args.iters:
        cmd += ["--iters", str(args.iters)]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TF runs as a user would start it: without the glibc tunable sdprun adds for sdp's workers
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and t != STREAMING_COPIES]
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    logpath = os.path.join(outdir, f"tf_{r}.log")
    try:
        with open(logpath, "w") as logf:
            proc = subprocess.run(cmd, env=env, stdout=None if r == 0 else subprocess.DEVNULL,
                                  stderr=logf, timeout=args.baseline_timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if r != 0:
        return None, None
    if rc != 0:
        with open(logpath) as f:
            tail = f.read()[-1500:]
        return None, f"tf baseline failed (rc={rc}); log tail:\n{tail}"
    files = [os.path.join(outdir, f"tf_{i}.json") for i in range(2)]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f) for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        docs = [json.load(open(f)) for f in files]
    except (OSError, ValueError) as e:
        return None, f"tf baseline: could not read results: {e}"
    med = {}
    for res in zip(*(d["results"] for d in docs)):
        med[res[0]["bytes"]] = max(x["median_s"] for x in res)
    return med, f"tf {docs[0]['tf_version']}, MultiWorkerMirroredStrategy RING, {docs[0]['workers']} workers"


def horovod_status() -> str:
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        return "horovod: not installed"
    sdp_dir = os.path.dirname(os.path.abspath(sdp.__file__))
    origin = os.path.abspath(spec.origin or "")
    if origin.startswith(sdp_dir):
        return "horovod: not installed (the 'horovod' module found is sdp's compatibility alias)"
    # A real Horovod needs its own launcher (horovodrun / gloo rendezvous); not driven from sdprun.
    return ("horovod: installed but not measured (needs horovodrun; run a Horovod allreduce benchmark "
            "separately)")


# ---- across hosts: flat ring vs hierarchical, and the link itself ---------------------------------
TARGET_HIER_VS_CEILING = 0.8       # hierarchical busbw at 64 MB / the link's ceiling (issue 15)
TARGET_HIER_VS_FLAT = 1.5          # hierarchical busbw / flat ring busbw at 64 MB
HOSTS_MIN_BYTES = 1 << 20          # the across-hosts table covers the sizes from 1 MB up


def host_only(hier):
    """A copy of the engine's hierarchy whose cross groups hold this rank alone: the hierarchical
    allreduce then does all its host-local work (copies into shared memory, reductions, pushes
    into the local peers' outputs, barriers) and skips the exchange between hosts.  Its results
    are per-host sums: for timing only."""
    import copy
    from sdp.engine.groups import Group
    local = copy.copy(hier)
    local.cross = {j: Group(g.mesh, [g.mesh.rank], g.tag) for j, g in hier.cross.items()}
    return local


def time_flat_and_hierarchical(buf, args):
    """Median times of the flat algorithms (ZeroMQ ring / recursive doubling over all ranks), of
    the hierarchical allreduce and of its host-local work alone (:func:`host_only`; both left
    out when this job has no hierarchy), max over ranks, measured alternately.  Switches the
    engine's ``hierarchy`` between collectives, after a barrier, on every rank alike (all ranks
    run the same collectives in the same order)."""
    rt = sdp.api.runtime()
    hier, out = rt.hierarchy, {}
    modes = {"flat": None}
    if hier is not None:
        modes.update(hierarchical=hier, local=host_only(hier))
    times = {}
    for mode, h in modes.items():
        sdp.barrier()
        rt.hierarchy = h
        # host-local: each host's ranks reduce among themselves (so does the planning's max over
        # ranks): the hierarchical run's count, the same on every rank
        iters = args.iters or (len(times["hierarchical"]) if mode == "local" else 0)
        times[mode] = time_allreduce(buf, iters, args.warmup, args.target_s, name=f"hosts.{mode}")
    sdp.barrier()
    rt.hierarchy = hier
    for mode, t in times.items():
        out[mode] = (max_over_ranks(statistics.median(t), f"hosts.{mode}.median"), len(t))
    return out


def link_bandwidth(seconds: float = 2.0, chunk: int = 4 << 20):
    """Raw TCP bandwidth between rank 0 and the first rank on another host, both directions at
    once: two plain TCP sockets (:func:`latency.link_sockets`), one sending each way for
    ``seconds``; each receiver counts bytes from its first byte to EOF.  Returns ``(a_to_b,
    b_to_a, a, b)`` in bytes/s on rank 0, None elsewhere."""
    import threading
    socks, b = latency.link_sockets(2)
    rank = sdp.rank()

    def send(sock):
        data = memoryview(bytearray(chunk))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)

    def receive(sock):
        buf, got, first = memoryview(bytearray(chunk)), 0, None
        while True:
            k = sock.recv_into(buf)
            if not k:
                return got / (time.perf_counter() - first)
            if first is None:
                first = time.perf_counter()
            got += k

    rate_in = None
    if socks:
        out_sock, in_sock = socks if rank == 0 else socks[::-1]  # (socket 0: rank 0 sends on it)
        sender = threading.Thread(target=send, args=(out_sock,))
        sender.start()
        rate_in = receive(in_sock)
        sender.join()
        for sk in socks:
            sk.close()
    rates = sdp.allgather_object(rate_in, name="link.rates")
    return (rates[b], rates[0], 0, b) if rank == 0 else None


def across_hosts(args, sizes, dtype):
    """The across-hosts table: flat vs hierarchical per size >= 1 MB, and the link bandwidth;
    returns ``(rows, link, hosts)`` (``link`` only on rank 0), or None when every rank is on one host."""
    hosts = latency.job_hosts()
    if len(set(hosts)) < 2:
        return None
    rows = []
    for nbytes in [s for s in sizes if s >= HOSTS_MIN_BYTES]:
        buf = np.ones(nbytes // dtype.itemsize, dtype)
        rows.append((nbytes, time_flat_and_hierarchical(buf, args)))
        del buf
    return rows, link_bandwidth(args.link_seconds), hosts


def report_across_hosts(rows, link, hosts, n) -> None:
    """Print the across-hosts table, the link's ceiling and the issue-15 targets (rank 0)."""
    nh = len(set(hosts))
    bf = busbw_factor(n)
    a_to_b, b_to_a, a, b = link
    bw = min(a_to_b, b_to_a)
    # every host must send (and receive) 2(H-1)/H of the buffer over its link (reduce-scatter +
    # allgather among the hosts), so t >= 2(H-1)/H * S / bw, algbw <= bw * H / (2(H-1))
    ceil_alg = bw * nh / (2 * (nh - 1))
    ceiling = ceil_alg * bf
    counts = ",".join(str(hosts.count(h)) for h in dict.fromkeys(hosts))
    print("", flush=True)
    print(f"across {nh} hosts ({counts} ranks), {n} ranks: allreduce (SUM, float32 unless --dtype), "
          f"flat = ring/recursive doubling over all ranks (ZeroMQ), hierarchical = shared memory per "
          f"host + ZeroMQ between hosts", flush=True)
    print(f"link: raw TCP between rank {a} ({hosts[a]}) and rank {b} ({hosts[b]}), two sockets, both "
          f"directions at once: {a_to_b / 1e9:.3f} GB/s {hosts[a]}->{hosts[b]}, {b_to_a / 1e9:.3f} GB/s "
          f"{hosts[b]}->{hosts[a]}", flush=True)
    print(f"ceiling: each host sends and receives >= 2(H-1)/H of the buffer over its link, so "
          f"algbw <= link * H/(2(H-1)) = {bw / 1e9:.3f} * {nh}/{2 * (nh - 1)} = {ceil_alg / 1e9:.3f} GB/s; "
          f"busbw = algbw*2(n-1)/n <= {ceiling / 1e9:.3f} GB/s (link = the slower direction)", flush=True)
    hdr = (f"{'size(B)':>10} | {'flat(us)':>10} {'flat_busbw':>10} | {'hier(us)':>10} {'hier_busbw':>10} | "
           f"{'hier/flat':>9} {'hier/ceiling':>12} | {'local(us)':>10}")
    print(hdr, flush=True)
    print("-" * len(hdr), flush=True)
    for nbytes, t in rows:
        flat_bus = nbytes / t["flat"][0] / 1e9 * bf
        if "hierarchical" in t:
            hb = nbytes / t["hierarchical"][0] / 1e9 * bf
            hier = (f"{t['hierarchical'][0] * 1e6:10.1f} {hb:10.3f} | {hb / flat_bus:9.2f} "
                    f"{hb / (ceiling / 1e9):12.2f} | {t['local'][0] * 1e6:10.1f}")
        else:
            hier = f"{'n/a':>10} {'n/a':>10} | {'n/a':>9} {'n/a':>12} | {'n/a':>10}"
        print(f"{nbytes:>10d} | {t['flat'][0] * 1e6:10.1f} {flat_bus:10.3f} | {hier}", flush=True)
    r64 = next((t for nbytes, t in rows if nbytes == 64 << 20), None)
    if r64 is None or "hierarchical" not in r64:
        print("  hierarchical @64MB targets: SKIP (needs 64M in --sizes and a hierarchy: several hosts, "
              "one with several ranks, SDP_HIERARCHICAL not 0)", flush=True)
        return
    hb = (64 << 20) / r64["hierarchical"][0] * bf
    fb = (64 << 20) / r64["flat"][0] * bf
    print(f"  hierarchical busbw @64MB >= {TARGET_HIER_VS_CEILING:.0%} of the ceiling: {hb / 1e9:.3f} GB/s = "
          f"{hb / ceiling:.0%}  {'PASS' if hb >= TARGET_HIER_VS_CEILING * ceiling else 'FAIL'}", flush=True)
    print(f"  hierarchical busbw @64MB >= {TARGET_HIER_VS_FLAT}x flat: {hb / fb:.2f}x  "
          f"{'PASS' if hb >= TARGET_HIER_VS_FLAT * fb else 'FAIL'}", flush=True)
    # where the link alone limits: the flat ring (each host's ranks adjacent in it) sends 2(n-1)/n
    # of the buffer over each host's link, the hierarchical path 2(H-1)/H
    print(f"  link-bound, hier/flat <= (2(n-1)/n) / (2(H-1)/H) = {(n - 1) / n * nh / (nh - 1):.2f}x "
          f"(the bytes over each host's link; a host's ranks adjacent in the flat ring)", flush=True)
    t_link = (64 << 20) / ceil_alg  # the ceiling's time: the link alone
    t_local = r64["local"][0]
    print(f"  the ceiling counts the link alone: {t_link * 1e3:.1f} ms at 64MB; the hierarchical path's "
          f"host-local work alone (shared-memory copies, reductions, barriers; no exchange between hosts) "
          f"took {t_local * 1e3:.1f} ms (local(us)); if the two cannot overlap (the same cores move the "
          f"link's bytes, as on unshaped emulated hosts), busbw <= "
          f"{(64 << 20) / (t_link + t_local) * bf / 1e9:.3f} GB/s = {t_link / (t_link + t_local):.0%} of the "
          f"ceiling", flush=True)


# ---- main ------------------------------------------------------------------------------------------
# ---- the API faces side by side (--api) -------------------------------------------------------------
API_CHOICES = ("numpy", "tf-eager", "tf-function")
TARGET_TF_1K_US = 500.0       # TF face, 1 KB allreduce, eager and in a tf.function (issue 19, item 5)
TARGET_TF_VS_ENGINE = 0.9     # TF face busbw / engine (numpy) busbw at 1 MB and 64 MB


def api_caller(api: str, buf: np.ndarray, name: str):
    """A no-argument callable doing one SUM allreduce of ``buf`` through ``api``: ``numpy``
    (``sdp.allreduce`` into a preallocated output), ``tf-eager`` (``sdp.tensorflow.allreduce``
    called eagerly), ``tf-function`` (the same inside a ``tf.function``) or ``floor`` (a
    ``tf.function`` whose one ``numpy_function`` calls ``sdp.allreduce``: no sdp.tensorflow code,
    the least a graph op of sdp's design can cost)."""
    if api == "numpy":
        out = np.empty_like(buf)
        return lambda: sdp.allreduce(buf, name=name, op=sdp.Sum, out=out)
    import tensorflow as tf

    import sdp.tensorflow as hvd
    x = tf.constant(buf)
    if api == "tf-eager":
        return lambda: hvd.allreduce(x, op=hvd.Sum, name=name)
    if api == "tf-function":
        fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name=name))
    else:  # the floor of a graph op of this design: the engine called from the one numpy_function
        fn = tf.function(lambda t: tf.numpy_function(lambda a: sdp.allreduce(a, name=name, op=sdp.Sum),
                                                     [t], t.dtype, stateful=True))
    return lambda: fn(x)


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


def compare_apis(args, apis, sizes, dtype) -> int:
    """``--api``: the same allreduce through each API, interleaved per size, printed side by side
    (median over iterations, max over ranks) with the TF face's targets."""
    n = sdp.size()
    med = {}
    rtt = None
    if 1024 in sizes and {"tf-eager", "tf-function"} & set(apis):  # (issue 30's targets are in round trips)
        sdp.barrier()
        rtt = max_over_ranks(latency.pipe_rtt() if sdp.rank() == 0 else 0.0, "api.rtt")
    for nbytes in sizes:
        buf = np.ones(nbytes // dtype.itemsize, dtype)
        for api in apis + (["floor"] if "tf-function" in apis else []):
            warmup = max(args.warmup, 20) if nbytes <= 4096 else args.warmup
            iters = args.iters or (max(200, args.latency_iters) if nbytes <= 4096 else 0)
            times = time_calls(api_caller(api, buf, f"api.{api}.{nbytes}"), iters, warmup, args.target_s,
                               f"api.{api}.{nbytes}")
            med[api, nbytes] = (max_over_ranks(statistics.median(times), f"api.{api}.med"), len(times))
        del buf
    floors = {}
    if "tf-function" in apis:  # what any tf.function step with one Python op costs, no collective
        import tensorflow as tf
        x = tf.constant(np.ones(max(1, 1024 // dtype.itemsize), dtype))
        empty = tf.function(lambda t: t + 1)
        # sdp's graph op without SdpCall is a numpy_function (zero-copy in and out, so this floor does not
        # grow with size); SdpCall costs ~30 us less (benchmarks/tf_call_op.py): a bound from it is an upper one
        one_op = tf.function(lambda t: tf.numpy_function(lambda a: a, [t], t.dtype, stateful=True))
        for key, fn in (("empty", empty), ("op", one_op)):
            times = time_calls(lambda: fn(x), 500, 20, args.target_s, "api.floor")
            floors[key] = max_over_ranks(statistics.median(times), "api.floor.med")

    def bound(api, nbytes):
        """(fastest time any design of this kind can reach for ``api`` at ``nbytes``, how it is made
        up): the engine's own time, plus for a tf.function the floor of its one Python op."""
        eng = med["numpy", nbytes][0]
        if api == "tf-function" and floors:
            add = eng + floors["op"]
            direct = med["floor", nbytes][0]
            return max(add, direct), (f"engine {eng * 1e6:.0f} us + one-numpy_function tf.function "
                                      f"{floors['op'] * 1e6:.0f} us = {add * 1e6:.0f} us; measured: sdp.allreduce "
                                      f"inside one numpy_function of a tf.function {direct * 1e6:.0f} us")
        return eng, f"engine {eng * 1e6:.0f} us (an eager collective calls it directly)"
    if sdp.rank() == 0:
        bf = busbw_factor(n)
        print("", flush=True)
        print(f"allreduce (SUM, {args.dtype}) by API, {n} ranks; time = median over iterations, max over "
              f"ranks (us); busbw GB/s; numpy = sdp.allreduce into a preallocated output", flush=True)
        cols = apis + (["floor"] if "tf-function" in apis else [])
        hdr = f"{'size':>6} " + " ".join(f"{a + ' us':>15} {'busbw':>7}" for a in cols)
        if "numpy" in apis:
            hdr += "  " + " ".join(f"{a + '/numpy':>17}" for a in apis if a != "numpy")
        print(hdr, flush=True)
        print("-" * len(hdr), flush=True)
        for nbytes in sizes:
            line = f"{fmt_size(nbytes):>6} "
            line += " ".join(f"{med[a, nbytes][0] * 1e6:15.1f} {nbytes / med[a, nbytes][0] / 1e9 * bf:7.3f}"
                             for a in cols)
            if "numpy" in apis:
                line += "  " + " ".join(f"{med['numpy', nbytes][0] / med[a, nbytes][0]:16.2f}x"
                                        for a in apis if a != "numpy")
            print(line, flush=True)
        print("", flush=True)
        print(f"targets (2 ranks, float32; {'applicable' if n == 2 and args.dtype == 'float32' else 'n/a here'}):",
              flush=True)
        for api in (a for a in apis if a != "numpy"):
            # a missed target gets the floor-based bound next to it (everything measured in this run)
            if 1024 in sizes:
                t = med[api, 1024][0] * 1e6
                ok = t <= TARGET_TF_1K_US
                why = ""
                if not ok and "numpy" in apis:
                    b, parts = bound(api, 1024)
                    why = f" (bound by the floor: {parts} -> >= {b * 1e6:.0f} us)"
                    if b * 1e6 > TARGET_TF_1K_US:
                        why += " (the floor itself misses the target)"
                print(f"  {api} 1 KB <= {TARGET_TF_1K_US:.0f} us: {t:.1f} us  {'PASS' if ok else 'FAIL'}{why}",
                      flush=True)
            for nbytes in (1 << 20, 64 << 20):
                if nbytes in sizes and "numpy" in apis:
                    r = med["numpy", nbytes][0] / med[api, nbytes][0]
                    ok = r >= TARGET_TF_VS_ENGINE
                    why = ""
                    if not ok:
                        b, parts = bound(api, nbytes)
                        why = f" (bound by the floor: {parts} -> <= {med['numpy', nbytes][0] / b:.2f}x)"
                    print(f"  {api} busbw @{fmt_size(nbytes)} >= {TARGET_TF_VS_ENGINE}x numpy: {r:.2f}x  "
                          f"{'PASS' if ok else 'FAIL'}{why}", flush=True)
        if rtt is not None:  # issue 30: eager <= 2 round trips, a tf.function <= its floor + 1 round trip
            print(f"issue 30 targets (RTT = the pipe ping-pong round trip, {rtt * 1e6:.1f} us in this run):", flush=True)
            for api, limit, what in (("tf-eager", 2 * rtt, "2 RTT"),
                                     ("tf-function", med.get(("floor", 1024), (0.0,))[0] + rtt, "floor + 1 RTT")):
                if api in apis:
                    t = med[api, 1024][0]
                    print(f"  {api} 1 KB <= {what}: {t * 1e6:.1f} us <= {limit * 1e6:.1f} us  "
                          f"{'PASS' if t <= limit else 'FAIL'}", flush=True)
        if floors:
            print(f"floor of a graph-mode op (same run, 1 KB, no collective): an empty tf.function call "
                  f"{floors['empty'] * 1e6:.1f} us; a tf.function with one numpy_function (sdp's graph op without SdpCall) "
                  f"{floors['op'] * 1e6:.1f} us; column 'floor': a tf.function whose one numpy_function calls "
                  f"sdp.allreduce (no sdp.tensorflow code)", flush=True)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load at end [{load}]", flush=True)
    sdp.shutdown()
    return 0


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
