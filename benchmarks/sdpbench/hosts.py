"""The across-hosts table of ``benchmarks/allreduce.py`` (ranks on several hosts only): flat ring
against hierarchical allreduce from 1 MB up, the hierarchical path's host-local work alone, the
raw TCP bandwidth between two hosts and the busbw a perfect algorithm would reach on that link,
with issue 15's targets."""
import socket
import statistics
import time

import numpy as np

import latency  # (benchmarks/latency.py: benchmarks/ is on sys.path wherever sdpbench is)
import sdp
from sdpbench.common import busbw_factor, max_over_ranks
from sdpbench.measure import time_allreduce

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
