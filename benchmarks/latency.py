"""Small-message latency against the machine's own floor, measured in the same run (issue 30).

Called by ``benchmarks/allreduce.py`` (its 1 KB latency section, and alone with
``--latency-only``).  What it measures, on every rank of an initialized job:

* **floor**: the round trip of a bare pipe ping-pong between two processes of this host
  (rank 0 and a child Python process it starts; one byte each way, blocking reads, so each
  hop is one wake-up of a sleeping process).  Small-message cost is set by how fast the
  machine wakes a sleeping process, which differs several-fold between machines, so every
  latency target is a multiple of this round trip (``RTT``).
* **back to back**: ``sdp.allreduce`` of 1 KB / 64 KB called in a loop (median per rank, then
  the maximum over ranks: the method of the size table).
* **isolated**, as a training step meets a collective: each one after a barrier and ~1 ms
  without collectives (so the engine thread has gone idle), timed from the last rank's call to
  the last rank's result (``max(end) - max(start)`` over ranks, one monotonic clock on a host),
  median over iterations.
* **a step of 100 cached 4 KB tensors**: one ``grouped_allreduce`` (the target's), the same
  through ``grouped_allreduce_async`` and a wait per tensor (as a framework face submits a
  gradient list), and the 100 submitted one by one (``allreduce_async`` each, then wait all),
  each way back to back in a run of its own, against the memory time of its bytes (one
  ``np.copyto`` of 400 KB, timed here).

The run is 5 rounds; each takes the floors (the round trip, and the link floors or the data
floor below) just before its latencies, and every number printed is the median of the rounds, so the
floors and the latencies meet the same phases of a machine whose speed changes.  Everything but
the floors is measured twice in the same run: as sdp runs (small allreduces in the
fast lane, :mod:`sdp.engine.lane`, when every rank is on one host; across hosts inline with the
negotiation, :mod:`sdp.engine.inline`) and with both set aside (:func:`lane_off`: the engine
thread, rank 0's coordinator and the collective, as before them).

* across hosts, also the **link floors**: the round trip of 1 KB over a plain TCP connection
  between rank 0 and the first rank on another host (:func:`tcp_rtt`), and on two hosts the
  floor of the host leaders' link's shape (:func:`link_floor`, ``benchmarks/link_floor.c``
  compiled here): the same allreduce through shared memory and one TCP exchange between the
  leaders, in C, with every rank of the job running it at once.  A bound below it cannot be met
  on this machine by an allreduce of that shape.
* on one host, also the **data floor** of 64 KB and of the step's bytes: what moving them costs
  with no control at all (:func:`data_floor`, ``benchmarks/shm_floor.c`` compiled here).  A
  target whose bound is below it cannot be met on this machine by an allreduce that copies its
  bytes into shared memory and reduces a peer's copy, as the fast lane does.

Targets (2 ranks, one host; issue 30): engine 1 KB <= 1.5 RTT back to back and <= 2 RTT isolated;
64 KB <= 2 RTT back to back; the 100-tensor step <= 5 RTT + its memory time, one by one <= 3x that.
Ranks on several hosts (2 x 2): 1 KB back to back <= 2 TCP round trips.
"""
import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

import sdp

TARGET_1K_B2B_RTT = 1.5
TARGET_1K_ISOLATED_RTT = 2.0
TARGET_64K_B2B_RTT = 2.0
TARGET_STEP_RTT = 5.0        # + the memory time of the step's bytes
TARGET_STEP_ONE_BY_ONE = 3.0  # x the grouped step's bound
TARGET_1K_HOSTS_TCP_RTT = 2.0  # ranks on several hosts: x the TCP round trip between two of them
STEP_COUNT, STEP_BYTES = 100, 4096
IDLE_S = 0.001  # seconds without collectives before each isolated one

_ECHO = ("import os\n"
         "r, w = 0, 1\n"
         "while True:\n"
         "    b = os.read(r, 1)\n"
         "    if not b:\n"
         "        break\n"
         "    os.write(w, b)\n")


def pipe_rtt(iters: int = 2000, warmup: int = 200, idle_s: float = 0.0) -> float:
    """Median seconds of one round trip of one byte between this process and a child Python
    process over two pipes (both block in ``read``): the wake-up floor of this machine.
    ``idle_s``: sleep this long before each round trip (both processes idle, as before an
    isolated collective)."""
    child = subprocess.Popen([sys.executable, "-S", "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             bufsize=0)
    w, r = child.stdin.fileno(), child.stdout.fileno()
    times = []
    try:
        for i in range(warmup + iters):
            if idle_s:
                time.sleep(idle_s)
            t0 = time.perf_counter()
            os.write(w, b"x")
            os.read(r, 1)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        child.stdin.close()
        child.wait(timeout=10)
        child.stdout.close()
    return statistics.median(times)


def job_hosts() -> list:
    """Every rank's host name (index = rank), as registered at rendezvous."""
    return [p["host"] for p in sdp.api.runtime().mesh.peers] or [platform.node()]


def link_sockets(count: int):
    """``count`` plain TCP connections between rank 0 and the first rank on another host (rank
    ``b``; rank 0 connects to that rank's data-interface address), in the same order on both
    ends.  Each proves itself with a token handed out over sdp (authenticated); anything else
    that connects is closed (at most ``count + 6`` connections are looked at).  Returns
    ``(sockets, b)``: the sockets on ranks 0 and ``b``, ``[]`` elsewhere (every rank calls it)."""
    hosts = job_hosts()
    b = next(r for r in range(sdp.size()) if hosts[r] != hosts[0])
    rank, listener, where = sdp.rank(), None, None
    if rank == b:
        ip = sdp.api.runtime().mesh.endpoints["tcp"][len("tcp://"):].rsplit(":", 1)[0]
        listener = socket.create_server((ip, 0), backlog=count + 2)
        listener.settimeout(30)
        where = listener.getsockname()[:2]
    where = sdp.broadcast_object(where, b, name="link.where")
    token = sdp.broadcast_object(os.urandom(16).hex() if rank == 0 else None, 0, name="link.token").encode()
    if rank == 0:
        socks = [socket.create_connection(tuple(where), timeout=30) for _ in range(count)]
        for i, sk in enumerate(socks):
            sk.sendall(token + bytes([i]))
        return socks, b
    if rank != b:
        return [], b
    by_index = {}
    for _ in range(count + 6):  # bounded: a stranger's connections are dropped
        sk, _ = listener.accept()
        sk.settimeout(30)
        hello = b""
        while len(hello) < len(token) + 1:
            piece = sk.recv(len(token) + 1 - len(hello))
            if not piece:
                break
            hello += piece
        if hello[:-1] == token and hello[-1] < count:
            by_index[hello[-1]] = sk
        else:
            sk.close()
        if len(by_index) == count:
            break
    listener.close()
    return [by_index[i] for i in range(count)], b


def tcp_rtt(nbytes: int = 1024, iters: int = 2000, warmup: int = 200) -> float:
    """Median seconds of one round trip of ``nbytes`` over a plain TCP connection (no Nagle)
    between rank 0 and the first rank on another host (:func:`link_sockets`): the floor of a
    collective between hosts.  Every rank calls it; the result is the same on every rank."""
    socks, b = link_sockets(1)
    times = []
    if socks:
        sk = socks[0]
        sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg, buf = b"x" * nbytes, bytearray(nbytes)

        def read_all():
            got = 0
            while got < nbytes:
                k = sk.recv_into(memoryview(buf)[got:])
                if not k:
                    raise ConnectionError("the link's peer closed the connection")
                got += k

        for i in range(warmup + iters):
            t0 = time.perf_counter()
            if sdp.rank() == 0:
                sk.sendall(msg)
                read_all()
            else:
                read_all()
                sk.sendall(msg)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        sk.close()
    return max_over_ranks(statistics.median(times) if sdp.rank() == 0 else 0.0, "lat.tcp")


LINK_FLOOR_SHM_BYTES = 8 << 20  # bytes: the shared file link_floor.c maps (its Shared fits)


def link_floor(exe: Optional[str], nbytes: int = 1024, iters: int = 2000) -> Optional[float]:
    """Median seconds per allreduce of ``nbytes`` float32 done in the host leaders' link's shape
    with nothing of sdp around it (``benchmarks/link_floor.c``, ``exe`` from :func:`build_floor`,
    run by every rank at once): each host's other ranks post into shared memory and spin, its
    leader sums them, exchanges the partial with the other leader over a plain TCP connection
    (:func:`link_sockets`), sums and publishes.  The larger of the two leaders' medians; None
    (on every rank) unless the job spans exactly two hosts and every rank has ``exe``."""
    hosts = job_hosts()
    names = sorted(set(hosts), key=hosts.index)
    if len(names) != 2 or max_over_ranks(0.0 if exe else 1.0, "lat.lf.exe") > 0:
        return None
    socks, _ = link_sockets(1)
    rank = sdp.rank()
    local = [r for r in range(sdp.size()) if hosts[r] == hosts[rank]]
    token = sdp.broadcast_object(os.urandom(8).hex() if rank == 0 else None, 0, name="lat.lf.token")
    path = f"/dev/shm/sdp-link-floor-{token}-{names.index(hosts[rank])}"
    me = local.index(rank)
    if me == 0:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, LINK_FLOOR_SHM_BYTES)
        os.close(fd)
    sdp.barrier()
    seconds = 0.0
    try:
        extra = [str(socks[0].fileno())] if me == 0 else []
        out = subprocess.run([exe, path, str(me), str(len(local)), str(nbytes), str(iters)] + extra,
                             pass_fds=[int(x) for x in extra], check=True, capture_output=True, text=True,
                             timeout=120).stdout
        seconds = float(out) if me == 0 else 0.0
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError) as e:
        print(f"latency: the link floor was not measured on rank {rank}: {e} {getattr(e, 'stderr', '')}",
              file=sys.stderr)
        seconds = float("nan")
    finally:
        for sk in socks:
            sk.close()
        sdp.barrier()
        if me == 0:
            os.unlink(path)
    got = max_over_ranks(seconds, "lat.lf")
    return None if got != got else got  # (NaN: some rank failed)


DATA_FLOOR_SIZES = (65536, STEP_COUNT * STEP_BYTES)  # bytes: what the data floor is measured for


def build_floor(tmp: str, name: str) -> Optional[str]:
    """``benchmarks/<name>.c`` (``shm_floor``, ``link_floor``) compiled into directory ``tmp``
    with ``$CC`` (default ``cc``) at ``-O3 -march=native``: the program's path, or None (and a
    line on stderr saying why) without a compiler or where it fails."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        print(f"latency: no C compiler (cc): {name} is not measured", file=sys.stderr)
        return None
    exe = os.path.join(tmp, name)
    try:
        subprocess.run([cc, "-O3", "-march=native", "-o", exe, os.path.join(os.path.dirname(__file__), f"{name}.c")],
                       check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"latency: {name} was not built: {e} {getattr(e, 'stderr', '')}", file=sys.stderr)
        return None
    return exe


def data_floor(exe: str, sizes=DATA_FLOOR_SIZES) -> dict:
    """``{nbytes: seconds}``: the data floor of a 2-rank shared-memory allreduce of each size in
    ``sizes`` (bytes, multiples of 64), by ``exe`` (:func:`build_floor`): two processes
    pinned to two cores copy a private float32 input into shared memory, raise a flag, wait for
    the peer's and sum their input with the peer's copy into a private result, back to back
    (median per iteration, the larger of the two); ``{}`` (and a line on stderr) where it fails.
    Run on one rank while the others wait."""
    args = [str(a) for nbytes in sizes for a in (nbytes, 4000 if nbytes <= 65536 else 1000)]
    try:
        out = subprocess.run([exe] + args, check=True, capture_output=True, text=True, timeout=120).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"latency: the data floor was not measured: {e} {getattr(e, 'stderr', '')}", file=sys.stderr)
        return {}
    return {int(nbytes): float(seconds) for nbytes, seconds in (line.split() for line in out.splitlines())}


def max_over_ranks(x: float, name: str) -> float:
    return float(sdp.allreduce(np.array([x], np.float64), name=name, op=sdp.Max)[0])


def back_to_back(nbytes: int, iters: int, warmup: int = 50) -> float:
    """Median seconds per ``sdp.allreduce`` of ``nbytes`` float32 called in a loop, max over ranks."""
    buf, out = np.ones(max(1, nbytes // 4), np.float32), np.empty(max(1, nbytes // 4), np.float32)
    name = f"lat.b2b.{nbytes}"
    for _ in range(warmup):
        sdp.allreduce(buf, name=name, op=sdp.Sum, out=out)
    sdp.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sdp.allreduce(buf, name=name, op=sdp.Sum, out=out)
        times.append(time.perf_counter() - t0)
    return max_over_ranks(statistics.median(times), f"{name}.med")


def isolated(call, iters: int, name: str, warmup: int = 5) -> float:
    """Median seconds of ``call()`` run after a barrier and :data:`IDLE_S` idle, from the last
    rank's start to the last rank's end (perf_counter is CLOCK_MONOTONIC: one clock per host)."""
    spans = np.zeros((warmup + iters, 2), np.float64)
    for i in range(warmup + iters):
        sdp.barrier()
        time.sleep(IDLE_S)
        t0 = time.perf_counter()
        call()
        spans[i] = (t0, time.perf_counter())
    every = sdp.allgather(spans[warmup:].reshape(1, -1), name=f"{name}.spans").reshape(sdp.size(), iters, 2)
    return float(np.median(every[:, :, 1].max(axis=0) - every[:, :, 0].max(axis=0)))


def step_times(iters: int, warmup: int = 5):
    """(grouped, grouped asynchronously, one by one, memory) median seconds, max over ranks, of a
    step of :data:`STEP_COUNT` cached tensors of :data:`STEP_BYTES`, back to back as the 1 KB
    rows are: each way in its own run of ``iters`` steps after ``warmup`` and a barrier:
    ``sdp.grouped_allreduce`` (the issue's step), ``grouped_allreduce_async`` and a wait per
    tensor (what a framework face submitting a gradient list does), ``allreduce_async`` each
    then a wait each.  (Interleaving the three ways, as this did before, timed the grouped step
    from the end of a one-by-one step, whose tail ends at different times on different ranks:
    here 182-190 us on the rank that waited for the other against 97-102 us back to back,
    125-141 us after a barrier.)"""
    grads = [np.full(STEP_BYTES // 4, i, np.float32) for i in range(STEP_COUNT)]
    names = [f"lat.step.{i}" for i in range(STEP_COUNT)]
    src, dst = np.ones(STEP_COUNT * STEP_BYTES // 4, np.float32), np.empty(STEP_COUNT * STEP_BYTES // 4, np.float32)

    def grouped():
        sdp.grouped_allreduce(grads, name="lat.step", op=sdp.Sum)

    def grouped_async():
        for h in sdp.api.grouped_allreduce_async(grads, names=names, op=sdp.Sum):
            h.wait()

    def one_by_one():
        for h in [sdp.allreduce_async(g, name=n, op=sdp.Sum) for g, n in zip(grads, names)]:
            h.wait()

    def memory():
        np.copyto(dst, src)

    medians = []
    for key, fn in (("g", grouped), ("a", grouped_async), ("o", one_by_one), ("m", memory)):
        for _ in range(warmup):
            fn()
        sdp.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        medians.append(max_over_ranks(statistics.median(times), f"lat.step.{key}"))
    return tuple(medians)


@contextlib.contextmanager
def lane_off():
    """Run the body with the fast lane and inline allreduces set aside on every rank (between
    two barriers, so no rank posts to the lane meanwhile): small allreduces take the engine
    thread, rank 0's coordinator and then the collective."""
    rt = sdp.api.runtime()
    sdp.barrier()
    saved = rt.lane, rt._inline, rt.front, rt.front_group, rt.link
    rt.lane, rt._inline, rt.front, rt.front_group, rt.link = None, False, None, None, None
    try:
        yield
    finally:
        sdp.barrier()
        rt.lane, rt._inline, rt.front, rt.front_group, rt.link = saved


def measure(iters: int = 500, isolated_iters: int = 200, step_iters: int = 100, rounds: int = 5) -> dict:
    """Every latency of the module docstring (seconds), the same on every rank: ``res[key]``
    as sdp runs, ``res["off"][key]`` with the fast lane set aside, and the floors they are held
    against.  The run is ``rounds`` rounds (each a ``rounds``-th of the iterations), each of its
    floors (:func:`floors`), then the lane set aside, then as sdp runs; every number is the
    median of its rounds.  A machine whose speed changes during the run (this VM's does, for
    seconds at a time: the pipe round trip read 6 us in one and 60 us in the next) then moves
    the floors with the latencies, and both columns alike.  (One floor taken before the whole
    run held a run's latencies against another phase's floor, either way.)"""
    sdp.barrier()
    several_hosts = len(set(job_hosts())) > 1
    res = {}
    parts = [max(1, n // rounds) for n in (iters, isolated_iters, step_iters)]
    on, off, floor = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        exe = (build_floor(tmp, "link_floor") if several_hosts
               else build_floor(tmp, "shm_floor") if sdp.rank() == 0 else None)
        for _ in range(rounds):
            floor.append(floors(several_hosts, exe))
            with lane_off():
                off.append(_latencies(*parts))
            on.append(_latencies(*parts))
    keys = set(floor[0]).intersection(*floor[1:])  # (a data floor a round could not measure: left out)
    res.update({k: statistics.median(r[k] for r in floor) for k in keys})
    res["rtt_rounds"] = [r["rtt"] for r in floor]
    step_key = f"floor_{DATA_FLOOR_SIZES[-1]}"
    res["data_floor_rounds"] = [r[step_key] for r in floor if step_key in r]
    res["off"] = {k: statistics.median(r[k] for r in off) for k in off[0]}
    res.update({k: statistics.median(r[k] for r in on) for k in on[0]})
    res["rtt_idle"] = max_over_ranks(pipe_rtt(isolated_iters, 10, IDLE_S) if sdp.rank() == 0 else 0.0, "lat.rtt3")
    return res


def floors(several_hosts: bool, exe: Optional[str] = None) -> dict:
    """One round's floors (seconds, the same on every rank): ``rtt`` (:func:`pipe_rtt`, on rank 0
    while the others wait); across hosts, ``tcp_rtt`` and, with every rank's ``link_floor``
    program ``exe``, ``link_floor`` (:func:`link_floor`; none where it failed); on one host, with
    rank 0's ``shm_floor`` program ``exe`` (:func:`build_floor`), ``floor_<nbytes>`` for each of
    :data:`DATA_FLOOR_SIZES` (:func:`data_floor`; none where it failed)."""
    sdp.barrier()
    res = {"rtt": max_over_ranks(pipe_rtt(1000, 100) if sdp.rank() == 0 else 0.0, "lat.rtt")}
    if several_hosts:
        res["tcp_rtt"] = tcp_rtt(iters=1000)
        lf = link_floor(exe, iters=1000)
        if lf is not None:
            res["link_floor"] = lf
    else:  # (the others wait here)
        got = sdp.broadcast_object(data_floor(exe) if exe is not None else {}, 0, name="lat.floor")
        res.update({f"floor_{nbytes}": seconds for nbytes, seconds in got.items()})
    return res


def _latencies(iters: int, isolated_iters: int, step_iters: int) -> dict:
    res = {}
    for nbytes in (1024, 65536):
        buf, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        name = f"lat.iso.{nbytes}"
        res[f"b2b_{nbytes}"] = back_to_back(nbytes, iters)
        res[f"iso_{nbytes}"] = isolated(lambda: sdp.allreduce(buf, name=name, op=sdp.Sum, out=out),
                                        isolated_iters, name)
    res["step_grouped"], res["step_grouped_async"], res["step_one_by_one"], res["step_memory"] = step_times(step_iters)
    return res


def report(res: dict) -> list:
    """Lines for rank 0: the table and the targets as multiples of the round trip."""
    rtt = res["rtt"]
    us = lambda s: f"{s * 1e6:8.1f} us"  # noqa: E731
    x = lambda s: f"{s / rtt:5.2f} RTT"  # noqa: E731
    rounds = res["rtt_rounds"]
    lines = [f"latency floor: pipe ping-pong round trip between two processes (RTT) {us(rtt)} "
             f"(the median of {len(rounds)} rounds', each taken before its round: "
             f"{min(rounds) * 1e6:.1f}-{max(rounds) * 1e6:.1f} us; each after {IDLE_S * 1e3:g} ms idle: "
             f"{us(res['rtt_idle'])})",
             f"{'':<44} {'sdp':>11} {'':>9}   {'lane off':>11} {'':>9}"]
    rows = [("1 KB back to back", "b2b_1024"), ("1 KB isolated (barrier, 1 ms idle)", "iso_1024"),
            ("64 KB back to back", "b2b_65536"), ("64 KB isolated", "iso_65536"),
            (f"step of {STEP_COUNT} x {STEP_BYTES // 1024} KB: grouped_allreduce", "step_grouped"),
            (f"step of {STEP_COUNT} x {STEP_BYTES // 1024} KB: grouped async + waits", "step_grouped_async"),
            (f"step of {STEP_COUNT} x {STEP_BYTES // 1024} KB: one by one (async)", "step_one_by_one"),
            ("memory time of the step's bytes (one copy)", "step_memory")]
    lines += [f"{label:<44} {us(res[k])} {x(res[k])}   {us(res['off'][k])} {x(res['off'][k])}" for label, k in rows]
    step_bound = TARGET_STEP_RTT * rtt + res["step_memory"]
    f64, fstep = res.get("floor_65536"), res.get(f"floor_{STEP_COUNT * STEP_BYTES}")
    if f64 is not None and fstep is not None:
        each = res["data_floor_rounds"]
        lines.append(f"data floor (copy into shared memory + reduce, two pinned processes, no control; "
                     f"shm_floor.c; the median of {len(each)} rounds', each beside its round): 64 KB {us(f64)} "
                     f"{x(f64)}, the step's {STEP_COUNT * STEP_BYTES // 1024} KB in one buffer {us(fstep)} "
                     f"{x(fstep)} ({min(each) * 1e6:.1f}-{max(each) * 1e6:.1f} us)")
    floor_name = "data floor"
    checks = [(f"1 KB back to back <= {TARGET_1K_B2B_RTT} RTT", res["b2b_1024"], TARGET_1K_B2B_RTT * rtt, None),
              (f"1 KB isolated <= {TARGET_1K_ISOLATED_RTT} RTT", res["iso_1024"], TARGET_1K_ISOLATED_RTT * rtt,
               None),
              (f"64 KB back to back <= {TARGET_64K_B2B_RTT} RTT", res["b2b_65536"], TARGET_64K_B2B_RTT * rtt, f64),
              (f"step grouped <= {TARGET_STEP_RTT:g} RTT + memory", res["step_grouped"], step_bound, fstep),
              (f"step one by one <= {TARGET_STEP_ONE_BY_ONE:g}x (grouped bound)", res["step_one_by_one"],
               TARGET_STEP_ONE_BY_ONE * step_bound, fstep)]
    if "tcp_rtt" in res:  # (ranks on several hosts: the one-host targets do not apply)
        tcp, lf = res["tcp_rtt"], res.get("link_floor")
        lines.append(f"link floor: TCP round trip of 1 KB between two hosts (no Nagle) {us(tcp)}")
        if lf is not None:
            lines.append(f"link floor of the leaders' link's shape: 1 KB through shared memory and one TCP exchange "
                         f"between the leaders, in C, every rank at once (link_floor.c) {us(lf)}")
        floor_name = "shape floor"
        checks = [(f"1 KB back to back across hosts <= {TARGET_1K_HOSTS_TCP_RTT:g} TCP RTT", res["b2b_1024"],
                   TARGET_1K_HOSTS_TCP_RTT * tcp, lf)]
    lines.append(f"latency targets (issue 30; {'ranks on several hosts' if 'tcp_rtt' in res else '2 ranks on one host'}):")
    lines += [f"  {label}: {t * 1e6:.1f} us <= {bound * 1e6:.1f} us  {'PASS' if t <= bound else 'FAIL'}"
              + ("" if below is None else f" ({floor_name} {below * 1e6:.1f} us"
                 + (": the bound is below it)" if below > bound else ")"))
              for label, t, bound, below in checks]
    return lines


# ---- where the time of one small collective goes (--breakdown) ----------------------------------
def breakdown(iters: int = 300, idle: bool = False) -> list:
    """Time stamps (perf_counter) of each phase of a 1 KB allreduce on every rank, taken by
    wrapping the engine's methods on this rank's runtime (instance attributes: nothing in the
    engine changes): submit (caller), engine awake (first ``pump`` return with the request
    queued), request sent, rank 0 holding every rank's request (its ``_coordinate``), response
    executed (start / end of ``_execute``), caller back.  Returns lines for rank 0: the median
    of each interval, per rank.  ``idle``: each collective after a barrier and 1 ms idle.  The
    engine path: with the fast lane and inline allreduces set aside (:func:`lane_off`)."""
    with lane_off():
        return _breakdown(iters, idle)


def _breakdown(iters: int, idle: bool) -> list:
    rt = sdp.api.runtime()
    now = time.perf_counter
    stamps = {}
    cur = {"i": -1}

    def mark(key):
        if cur["i"] >= 0:
            stamps.setdefault(cur["i"], {}).setdefault(key, now())

    def wrap(obj, attr, before=None, after=None):
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            if before:
                before(*a)
            r = fn(*a, **k)
            if after:
                after(*a)
            return r
        setattr(obj, attr, wrapper)
        return fn

    saved = [(rt, "submit_many", wrap(rt, "submit_many", before=lambda *_: mark("submit"))),
             (rt.mesh, "pump", wrap(rt.mesh, "pump", after=lambda *_: rt._queue and mark("awake"))),
             (rt, "_send_requests", wrap(rt, "_send_requests", after=lambda *_: mark("sent"))),
             (rt, "_execute", wrap(rt, "_execute", before=lambda *_: mark("exec"), after=lambda *_: mark("done")))]
    if rt._coord is not None:
        saved.append((rt, "_coordinate", wrap(rt, "_coordinate", before=lambda src, msg: mark(f"req{src}"))))
    buf, out = np.ones(256, np.float32), np.empty(256, np.float32)
    for i in range(iters + 20):
        if idle:
            sdp.barrier()
            time.sleep(IDLE_S)
        cur["i"] = i - 20 if i >= 20 else -1
        sdp.allreduce(buf, name="lat.breakdown", op=sdp.Sum, out=out)
        mark("back")
        cur["i"] = -1
    for obj, attr, fn in saved:
        setattr(obj, attr, fn)
    keys = ["submit", "awake", "sent", "exec", "done", "back"] + [f"req{r}" for r in range(sdp.size())]
    table = np.array([[stamps.get(i, {}).get(k, np.nan) for k in keys] for i in range(iters)])
    every = sdp.allgather(table.reshape(1, -1), name="lat.breakdown.all").reshape(sdp.size(), iters, len(keys))
    col = {k: j for j, k in enumerate(keys)}
    last_submit = np.nanmax(every[:, :, col["submit"]], axis=0)
    coord_all = np.nanmax(every[0][:, [col[f"req{r}"] for r in range(sdp.size())]], axis=1)
    lines = [f"where a 1 KB allreduce's time goes ({'each after a barrier and 1 ms idle' if idle else 'back to back'};"
             f" medians over {iters}, us; perf_counter stamps of one clock)"]
    med = lambda a: float(np.nanmedian(a)) * 1e6  # noqa: E731
    total = np.nanmax(every[:, :, col["back"]], axis=0) - last_submit
    lines.append(f"  last submit -> last caller back: {med(total):.1f}; rank 0 has every request "
                 f"{med(coord_all - last_submit):.1f} after the last submit")
    for r in range(sdp.size()):
        e = every[r]
        d = lambda a, b: med(e[:, col[b]] - e[:, col[a]])  # noqa: E731
        lines.append(f"  rank {r}: submit->engine awake {d('submit', 'awake'):.1f}, awake->request sent "
                     f"{d('awake', 'sent'):.1f}, sent->rank 0 has it {med(every[0][:, col[f'req{r}']] - e[:, col['sent']]):.1f}, "
                     f"all requests at rank 0->response executing here {med(e[:, col['exec']] - coord_all):.1f}, "
                     f"execute {d('exec', 'done'):.1f}, result->caller back {d('done', 'back'):.1f}")
    return lines
