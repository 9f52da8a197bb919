"""Worker functions for tests/test_hierarchical_mp.py (ranks on fake hosts, see SDP_HOSTNAME)."""
import hashlib

import numpy as np

import sdp
from workers_collectives import every_collective


def path_taken():
    """How this rank's collectives ran: [hierarchical allreduces, shared-memory barriers of its
    host group, parts, cross-group job ranks by part, host-group job ranks, hierarchical
    allgathers, allreduces completed inline (sdp.engine.inline), allreduces the host leaders'
    link ran (sdp.engine.hostlink)]."""
    rt = sdp.api.runtime()
    h, seg = rt.hierarchy, rt.mesh.host_shm
    linked = 0 if rt.link is None else rt.link.fast
    if h is None:
        return [0, 0 if seg is None else seg.barriers, [], {}, [], 0, rt.inline_allreduces, linked]
    return [h.allreduces, 0 if seg is None else seg.barriers, h.parts,
            {str(j): g.ranks for j, g in h.cross.items()}, h.host.ranks, h.allgathers, rt.inline_allreduces, linked]


def matrix_and_path(cases):
    """The collective matrix (list of bools), then :func:`path_taken`."""
    return [every_collective(cases), path_taken()]


def digests(sizes, zmq_barriers=False):
    """SHA-1 of the results of float32 SUM, float16 AVERAGE and float64 prescaled-SUM
    allreduces of the given sizes, one fused list too: equal on every rank when bit-identical;
    whether all results (allgathers with rank-dependent rows too) equal numpy's.
    ``zmq_barriers``: barriers by ZeroMQ messages, as on CPUs without ordered stores."""
    if zmq_barriers:
        from sdp.engine import barrier
        barrier.FLAGS_ORDERED = False  # read at every barrier; every rank sets it before its first
    r = sdp.rank()
    out, close = [], True
    for i, n in enumerate(sizes):
        rng = np.random.default_rng(1000 * i + r)
        a = rng.standard_normal(n).astype(np.float32)
        out.append(sdp.allreduce(a, name=f"f32.{i}", op=sdp.Sum))
        ref = sum(np.random.default_rng(1000 * i + q).standard_normal(n) for q in range(sdp.size()))
        close = close and np.allclose(out[-1], ref, rtol=1e-5, atol=1e-5)
        out.append(sdp.allreduce((a * 1000).astype(np.float16), name=f"f16.{i}", op=sdp.Average))
        out.append(sdp.allreduce(a.astype(np.float64), name=f"f64.{i}", op=sdp.Sum, prescale_factor=0.5))
    for rows in (lambda q: q % 3 + 1, lambda q: 0 if q % 2 else 300_000):  # some ranks without rows
        got = sdp.allgather(np.full((rows(r), 2), r, np.int32), name="ag")
        close = close and np.array_equal(got, np.concatenate([np.full((rows(q), 2), q, np.int32)
                                                              for q in range(sdp.size())]))
    fused = sdp.grouped_allreduce([np.full(n, r + 0.25, np.float32) for n in sizes], op=sdp.Average)
    expect = [np.full(n, (sdp.size() - 1) / 2 + 0.25, np.float32) for n in sizes]
    return [[hashlib.sha1(o.tobytes()).hexdigest() for o in out],
            bool(close) and all(np.array_equal(f, e) for f, e in zip(fused, expect)), path_taken()[:2]]


def inline_cases():
    """Small allreduces of every op and several dtypes (AVERAGE, postscale, a flattened group,
    ``out=``) against numpy: [all equal, SHA-1 of the results, allreduces completed inline,
    the ranks this rank sent control messages to through shared-memory rings]."""
    r, n = sdp.rank(), sdp.size()
    rng = [np.random.default_rng(q) for q in range(n)]
    base = [g.standard_normal(300) for g in rng]
    ok, out = True, []

    def allreduce(x, **kw):  # (asynchronous and alone: a synchronous one takes sdp.engine.hostlink)
        return sdp.allreduce_async(x, **kw).wait()
    for dtype in (np.float32, np.float64, np.float16, np.int32):
        xs = [(b * 100).astype(dtype) for b in base]
        for op, ref in ((sdp.Sum, sum(x.astype(np.float64) for x in xs)), (sdp.Min, np.minimum.reduce(xs)),
                        (sdp.Max, np.maximum.reduce(xs))):
            got = allreduce(xs[r], name=f"in.{np.dtype(dtype).name}.{op}", op=op)
            ok = ok and got.dtype == dtype and np.allclose(got.astype(np.float64), ref, rtol=2e-3, atol=1)
            out.append(got)
        avg = allreduce(xs[r], name=f"in.{np.dtype(dtype).name}.avg", op=sdp.Average)
        want = (sum(x.astype(np.int64) for x in xs) // n if dtype == np.int32
                else sum(x.astype(np.float64) for x in xs) / n)
        # (float16 across hosts: partial sums travel rounded to 16 bits, see DESIGN.md step 5)
        ok = ok and np.allclose(avg.astype(np.float64), want, rtol=2e-3, atol=0.25 if dtype == np.float16 else 1e-2)
        out.append(avg)
    scaled = allreduce(base[r].astype(np.float32), name="in.post", op=sdp.Sum, postscale_factor=0.5)
    ok = ok and np.allclose(scaled, sum(base) * 0.5, rtol=1e-5, atol=1e-5)
    buf = np.empty(300, np.float32)
    got = allreduce(base[r].astype(np.float32), name="in.out", op=sdp.Sum, out=buf)
    ok = ok and got is buf and np.allclose(buf, sum(base), rtol=1e-5, atol=1e-5)
    parts = sdp.grouped_allreduce([np.full(7, r, np.float32), np.full((2, 3), r, np.float32)], op=sdp.Sum)
    ok = ok and all(np.array_equal(p, np.full(p.shape, n * (n - 1) / 2, np.float32)) for p in parts)
    out += [scaled, buf] + parts
    rt = sdp.api.runtime()
    ctrl = rt.mesh.ctrl
    return [bool(ok), hashlib.sha1(b"".join(o.tobytes() for o in out)).hexdigest(), rt.inline_allreduces,
            [] if ctrl is None else sorted(q for q, written in ctrl._wpos.items() if written)]


def malformed_inline():
    """Rank 1's engine thread sends rank 0 malformed inline bodies (over TCP: the hosts are fake)
    before its real requests: rank 0 logs and drops them, and the allreduces that follow (inline
    ones among them) are exact."""
    import json
    import struct
    rt = sdp.api.runtime()
    head = json.dumps({"t": "req", "new": [], "ids": [], "in": ["x"], "il": [99]}).encode()
    bad = [b"I\x05\x00\x00\x00{}",  # a header longer than the body
           b"I" + struct.pack("<I", len(head)) + head + b"abc",  # lengths that do not add up
           b"I" + struct.pack("<I", 2) + b"{}"] if rt.rank == 1 else []  # (a request without "t")
    inner = rt._send_requests

    def send_bad_then_requests():
        while bad:
            rt.mesh.send_ctrl(0, bad.pop(0))
        inner()

    rt._send_requests = send_bad_then_requests
    out = [float(sdp.allreduce_async(np.full(3, 1.0 + k), name=f"ok{k}", op=sdp.Sum).wait()[0]) for k in range(3)]
    return [out, rt.inline_allreduces]
