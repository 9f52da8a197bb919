"""Workers that misbehave on purpose, for tests/test_errors_mp.py."""
import os
import random
import signal
import threading
import time

import numpy as np

import sdp
from sdp.common import errors


def _expect(fn):
    """Run fn; return (error type name, message, seconds) — or ('none', '', s) if it succeeded."""
    t = time.monotonic()
    try:
        fn()
    except errors.SdpError as e:
        return [type(e).__name__, str(e), time.monotonic() - t]
    return ["none", "", time.monotonic() - t]


def mismatch(kind):
    r = sdp.rank()
    cases = {
        "shape": lambda: sdp.allreduce(np.zeros([2, 3] if r == 0 else [3, 3], np.float32), name="grad_3"),
        "dtype": lambda: sdp.allreduce(np.zeros(4, np.float32 if r == 0 else np.float64), name="grad_3"),
        "op": lambda: sdp.allreduce(np.zeros(4), name="grad_3", op=sdp.Sum if r == 0 else sdp.Max),
        "collective": lambda: (sdp.allreduce if r == 0 else (lambda a, name: sdp.broadcast(a, 0, name)))(
            np.zeros(4), name="grad_3"),
        "root": lambda: sdp.broadcast(np.zeros(4), root_rank=r, name="grad_3"),
        "bad_root": lambda: sdp.broadcast(np.zeros(4), root_rank=5, name="grad_3"),
        "prescale": lambda: sdp.allreduce(np.zeros(4), name="grad_3", prescale_factor=1.0 + r),
        "allgather": lambda: sdp.allgather(np.zeros([2, 3 + r]), name="grad_3"),
        "postscale": lambda: sdp.allreduce(np.zeros(4), name="grad_3", postscale_factor=0.5 if r else 1.0),
        "allgather_dtype": lambda: sdp.allgather(np.zeros([2, 3], np.int32 if r else np.int64), name="grad_3"),
        "broadcast_shape": lambda: sdp.broadcast(np.zeros([4 + r]), 0, name="grad_3"),
        "reducescatter_shape": lambda: sdp.reducescatter(np.zeros([4, 2 + r]), name="grad_3"),
        "alltoall_splits": lambda: sdp.alltoall(np.zeros([4, 2]), splits=[1, 2] if r else [2, 2], name="grad_3"),
        "alltoall_negative": lambda: sdp.alltoall(np.zeros([4, 2]), splits=[-1, 5] if r else [2, 2], name="grad_3"),
    }
    res = _expect(cases[kind])
    # the engine keeps working after a mismatch
    ok = float(sdp.allreduce(np.ones(3), name="after", op=sdp.Sum)[0]) == sdp.size()
    return res + [ok]


def die_or_wait(victim, fused=False):
    """Rank ``victim`` kills itself mid-training; the others keep allreducing.  ``fused``: each
    step is a fused 8 MB gradient list (the shared-memory path, where most time is inside the
    collective) and the victim dies from a timer thread, at whatever point it has reached."""
    grads = [np.ones(262_144 if fused else 1000, np.float32) for _ in range(8 if fused else 1)]

    def step(k):
        for h in sdp.grouped_allreduce_async(grads, [f"s{k}.{i}" for i in range(len(grads))]):
            h.wait()

    t0, wire = time.monotonic(), sdp.api.has_wire()
    try:  # (the victim may die while a survivor still waits in step 2 for its messages)
        for k in range(100000):
            step(k)
            if k == 2 and sdp.rank() == victim:
                if not fused:
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    except errors.PeerLostError as e:
        return [type(e).__name__, str(e), e.rank, time.monotonic() - t0, wire]
    return ["none", "", -1, time.monotonic() - t0, wire]


def stall(_):
    if sdp.rank() == 0:
        return _expect(lambda: sdp.allreduce(np.ones(2), name="lonely"))
    # late past rank 0's stall shutdown: until its abort is here (at most STALL_SLEEP seconds)
    mesh, deadline = sdp.api.runtime().mesh, time.monotonic() + float(os.environ.get("STALL_SLEEP", "4"))
    while not mesh.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    return _expect(lambda: sdp.allreduce(np.ones(2), name="late"))


def random_order(n_tensors, seed):
    rng = random.Random(seed * 100 + sdp.rank())
    order = list(range(n_tensors))
    rng.shuffle(order)
    handles = {}
    for i in order:
        handles[i] = sdp.allreduce_async(np.full(i + 1, float(sdp.rank() + i), np.float32), name=f"t{i}",
                                         op=sdp.Sum)
        if rng.random() < 0.3:
            time.sleep(0.001)
    n = sdp.size()
    return all(np.allclose(handles[i].wait(), sum(q + i for q in range(n))) for i in range(n_tensors))


def foreign_message(_):
    import zmq
    rt = sdp.api.runtime()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.SNDTIMEO, 1000)  # the refused connection may be gone already: never block
    s.connect(rt.mesh.endpoints["tcp"])
    try:
        s.send_multipart([b"GARBAGE", b"\x00" * 10])
        s.send(b"x")
    except zmq.Again:
        pass
    # wait (bounded) until this rank's guard has logged the refusal: on a busy machine its thread
    # may read the monitor's events after the job would otherwise have ended
    refusals, deadline = rt.mesh._gate.refusals, time.monotonic() + 30
    while refusals.total == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close(linger=0)
    return float(sdp.allreduce(np.ones(2), name="after_garbage", op=sdp.Sum)[0])


def before_init_and_twice(_):
    res = [_expect(lambda: sdp.allreduce(np.ones(2)))]
    res.append(_expect(lambda: sdp.rank()))
    res.append(_expect(lambda: sdp.alltoall(np.ones(2))))
    res.append(_expect(lambda: sdp.broadcast_object({"a": 1})))
    sdp.init()
    rank, size = sdp.rank(), sdp.size()
    res.append(_expect(sdp.init))  # (Horovod's rule: nothing happens)
    res.append([sdp.is_initialized(), sdp.rank() == rank, sdp.size() == size,
                float(sdp.allreduce(np.ones(2), name="after_second_init", op=sdp.Sum)[0])])
    return res


def uneven_then_join(steps_by_rank):
    """Rank r runs steps_by_rank[r] SUM allreduces of ones, then join(); returns results + last."""
    outs = []
    for step in range(steps_by_rank[sdp.rank()]):
        outs.append(float(sdp.allreduce(np.ones(4, np.float32), name=f"step{step}", op=sdp.Sum)[0]))
    last = sdp.join()
    after = float(sdp.allreduce(np.ones(2), name="after_join", op=sdp.Sum)[0])
    return [outs, last, after]


def threads_submit(n_threads, per_thread):
    """Several threads per rank each allreduce their own sequence of tensors (the same sequence
    on every rank, as any blocking per-thread program must), with rank-dependent timing, so the
    threads' submissions interleave differently on every rank."""
    results, r = {}, sdp.rank()

    def work(t):
        order = list(range(per_thread))
        random.Random(t).shuffle(order)
        pause = random.Random(r * 31 + t)
        for i in order:
            time.sleep(pause.random() * 0.003)
            results[(t, i)] = float(sdp.allreduce(np.full(100 + i, float(t + i + r), np.float32),
                                                  name=f"th{t}.{i}", op=sdp.Sum)[0])

    ts = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    n = sdp.size()
    return all(results.get((t, i)) == sum(t + i + q for q in range(n))
               for t in range(n_threads) for i in range(per_thread))


def bool_average():
    """AVERAGE (or a scale factor) of a bool tensor is refused at once on the calling rank; the
    engine keeps working and bool SUM / MIN reduce as logical or / and."""
    flags = np.array([True, False, sdp.rank() == 0])
    errs = []
    for call in (lambda: sdp.allreduce(flags, name="avg"),
                 lambda: sdp.allreduce(flags, name="pre", op=sdp.Sum, prescale_factor=2.0),
                 lambda: sdp.reducescatter(np.ones([2, 2], bool), name="rs")):
        try:
            call()
            errs.append("none")
        except ValueError as e:
            errs.append(str(e))
    any_ = sdp.allreduce(flags, name="or", op=sdp.Sum).tolist()
    all_ = sdp.allreduce(flags, name="and", op=sdp.Min).tolist()
    return [errs, any_, all_]


MALFORMED_REQUESTS = [  # well framed (a peer's control message) but not a valid request
    {"t": "req", "new": "abc", "ids": []},
    {"t": "req", "new": [{"n": "x"}], "ids": []},
    {"t": "req", "new": [{"n": "x", "k": "allreduce", "d": "float99", "s": [2], "o": 1, "r": None,
                          "pre": 1.0, "post": 1.0, "sp": None}], "ids": []},
    {"t": "req", "new": [{"n": "x", "k": "allreduce", "d": "<f4", "s": [2], "o": 99, "r": None,
                          "pre": 1.0, "post": 1.0, "sp": None}], "ids": ["7", -1]},
    {"t": "req", "new": [None, 3], "ids": {"a": 1}},
    ["t", "req"],
]
MALFORMED_RESPONSES = [{"t": "resp"}, {"t": "resp", "items": "x"}, {"t": "resp", "items": [{"x": 1}]},
                       {"t": "resp", "bid": [1], "items": []}, {"t": "resp", "bid": 12345}]


def malformed_control():
    """Each rank's engine thread sends malformed control messages over its real sockets just
    before its real requests (rank 1: requests to the coordinator, rank 0: responses to rank 1);
    they are logged and dropped, and the allreduces that follow are exact."""
    import json
    rt = sdp.api.runtime()
    bad = MALFORMED_REQUESTS if rt.rank == 1 else MALFORMED_RESPONSES
    inner = rt._send_requests

    def send_bad_then_requests():
        while bad:
            rt.mesh.send_ctrl(0 if rt.rank == 1 else 1, json.dumps(bad.pop(0)).encode())
        inner()

    rt._send_requests = send_bad_then_requests
    time.sleep(0.2 * rt.rank)  # rank 0's responses first arrive before any real one
    out = [float(sdp.allreduce(np.full(3, 1.0 + k), name=f"ok{k}", op=sdp.Sum)[0]) for k in range(3)]
    return out


def unsupported_dtypes():
    """Arrays no collective can carry (Python objects) or no reduction can add (strings,
    complex) raise ValueError at once; strings still move through allgather and broadcast."""
    errs = []
    for call in (lambda: sdp.allreduce(np.array([{"x": 1}], dtype=object), name="obj", op=sdp.Sum),
                 lambda: sdp.broadcast(np.array([None, 1], dtype=object), 0, name="objb"),
                 lambda: sdp.allreduce(np.array(["a", "b"]), name="str", op=sdp.Sum),
                 lambda: sdp.reducescatter(np.ones([2, 2], np.complex64), name="cplx", op=sdp.Sum)):
        try:
            call()
            errs.append("none")
        except ValueError as e:
            errs.append(str(e).split(" is not supported")[0])
    moved = sdp.allgather(np.array(["ab", "c"]), name="strs").tolist()
    return [errs, moved, float(sdp.allreduce(np.ones(2), name="after", op=sdp.Sum)[0])]


def timed_shutdown(_):
    """Seconds this rank's ``sdp.shutdown()`` takes when every rank shuts down at about once."""
    sdp.allreduce(np.ones(4), name="before.shutdown")
    t = time.monotonic()
    sdp.shutdown()
    return time.monotonic() - t


def killed_while_receiving(nbytes):
    """Rank 1 stops (SIGSTOP) right after it asked for a broadcast of ``nbytes`` from rank 0; rank 0
    then broadcasts (over TCP most of the buffer stays queued in ZeroMQ, never released) and kills
    rank 1 1.5 s later.  Returns rank 0's (error type, message, lost rank, seconds in broadcast)."""
    pids = [int(p) for p in sdp.allgather(np.array([os.getpid()]), name="pids")]
    buf = np.ones(nbytes // 4, np.float32)
    if sdp.rank() == 1:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        sdp.broadcast(buf, root_rank=0, name="big")  # (stopped, then killed, in here)
        return None
    time.sleep(0.5)  # rank 1's request is in, and rank 1 is stopped
    threading.Timer(1.5, os.kill, (pids[1], signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        sdp.broadcast(buf, root_rank=0, name="big")
    except errors.SdpError as e:
        return [type(e).__name__, str(e), getattr(e, "rank", None), time.monotonic() - t0]
    return ["none", "", None, time.monotonic() - t0]


def killed_in_doorbell(victim, stamp_path):
    """Every rank allreduces a few times (control in shared memory on one host); then the survivors
    submit one more and wait for it (their engine threads asleep on the doorbell) while ``victim``
    writes ``time.monotonic()`` to ``stamp_path`` and kills itself with SIGKILL.  Returns
    (exception type, lost rank, monotonic time it was raised, control rings in use)."""
    rt = sdp.api.runtime()
    rings = rt.mesh.ctrl is not None and all(rt.mesh.ctrl.senders.values()) and bool(rt.mesh.ctrl.bells)
    for k in range(5):
        sdp.allreduce(np.ones(16, np.float32), name=f"warm.{k}")
    if sdp.rank() == victim:
        time.sleep(0.5)  # the others are waiting by now
        with open(stamp_path + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(stamp_path + ".tmp", stamp_path)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        sdp.allreduce(np.ones(16, np.float32), name="never")
    except errors.PeerLostError as e:
        return [type(e).__name__, e.rank, time.monotonic(), rings]
    return ["none", -1, time.monotonic(), rings]
