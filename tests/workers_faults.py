"""Workers for tests/test_faults_mp.py: faults made on purpose (stopped ranks, stalls, oversized
frames, unnamed collectives in a loop)."""
import os
import signal
import threading
import time

import numpy as np

import sdp
from sdp.common import errors


def stop_peer(stop_s):
    """Rank 0 stops rank 1 (SIGSTOP) for ``stop_s`` seconds while waiting on it in an allreduce.
    Returns (error type or 'none', message, seconds the allreduce took, its result)."""
    pids = [int(p) for p in sdp.allgather(np.array([os.getpid()]), name="pids")]
    if sdp.rank() == 0:
        os.kill(pids[1], signal.SIGSTOP)
        timer = threading.Timer(stop_s, os.kill, (pids[1], signal.SIGCONT))
        timer.start()
    else:
        time.sleep(1.0)  # (stopped in here) then the allreduce rank 0 already waits on
    t = time.monotonic()
    try:
        out = sdp.allreduce(np.ones(4), name="after_stop", op=sdp.Sum)
        res = ["none", "", time.monotonic() - t, out.tolist()]
    except errors.SdpError as e:
        res = [type(e).__name__, str(e), time.monotonic() - t, None]
    finally:
        if sdp.rank() == 0:
            timer.cancel()
            os.kill(pids[1], signal.SIGCONT)
    return res


def _zmtp_plain(endpoint, user, token, identity):
    """A raw TCP connection that speaks ZMTP 3.0 with the PLAIN mechanism by hand (RFC 23/24), as a
    DEALER with routing id ``identity``; returns the socket once the handshake is done."""
    import socket
    import struct
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)

    def recv_exact(n):
        data = b""
        while len(data) < n:
            more = s.recv(n - len(data))
            assert more, "connection closed in the handshake"
            data += more
        return data

    def command(name, body=b""):
        data = bytes([len(name)]) + name + body
        s.sendall(bytes([0x04, len(data)]) + data if len(data) < 256 else
                  bytes([0x06]) + struct.pack(">Q", len(data)) + data)

    def read_command():
        flags, = recv_exact(1)
        size = recv_exact(1)[0] if not flags & 0x02 else struct.unpack(">Q", recv_exact(8))[0]
        body = recv_exact(size)
        return body[1:1 + body[0]]

    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"PLAIN".ljust(20, b"\x00") + b"\x00" * 32)
    greeting = recv_exact(64)
    assert greeting[12:17] == b"PLAIN", greeting
    command(b"HELLO", bytes([len(user)]) + user + bytes([len(token)]) + token)
    assert read_command() == b"WELCOME"

    def prop(name, value):
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    command(b"INITIATE", prop(b"Socket-Type", b"DEALER") + prop(b"Identity", identity))
    assert read_command() == b"READY"
    return s


def oversized_and_foreign(announce_bytes):
    """Rank 0 (a holder of the secret, with a PLAIN token it issues itself) connects to its own
    mesh by hand twice: as rank 7 (not in the job) it sends a well-formed DATA message; as rank 9
    it sends a frame header announcing ``announce_bytes`` followed by 64 bytes.  Returns, on
    rank 0: (was the second connection closed by the receiver, growth of virtual memory in bytes,
    messages from outside the job in the inbox), then the result of an allreduce."""
    import struct
    import psutil
    from sdp.transport.zmq_mesh import DATA, HEADER, MAGIC
    mesh = sdp.api.runtime().mesh
    out = None
    if sdp.rank() == 0:
        ep = mesh.endpoints["tcp"]
        foreign = _zmtp_plain(ep, b"x7", mesh._gate.issue_token("x7").encode(), (7).to_bytes(4, "little"))
        head = HEADER.pack(MAGIC, DATA, 0, 1)
        foreign.sendall(bytes([0x01, len(head)]) + head + bytes([0x00, 64]) + b"\x07" * 64)
        vms0 = psutil.Process().memory_info().vms
        big = _zmtp_plain(ep, b"x9", mesh._gate.issue_token("x9").encode(), (9).to_bytes(4, "little"))
        big.sendall(bytes([0x01, len(head)]) + head + bytes([0x02]) + struct.pack(">Q", announce_bytes)
                    + b"\x07" * 64)
        big.settimeout(3.0)
        try:
            closed = big.recv(1) == b""
        except (TimeoutError, OSError):
            closed = False
        grown = psutil.Process().memory_info().vms - vms0
        mesh.pump(100)
        stray = sum(len(q) for (src, _), q in mesh.inbox.items() if not 0 <= src < mesh.size)
        foreign.close()
        big.close()
        out = [closed, grown, stray]
    x = sdp.allreduce(np.ones(4), name="after_oversized", op=sdp.Sum)
    return [out, float(x[0])]


def unnamed_loop(steps, names):
    """``steps`` unnamed allreduces and broadcasts with ``sdp.api.AUTO_NAMES = names``: returns the
    sizes of this rank's response cache and (rank 0) the coordinator's, and the last sum."""
    sdp.api.AUTO_NAMES = names
    rt = sdp.api.runtime()
    for i in range(steps):
        x = sdp.allreduce(np.full(3, float(i)), op=sdp.Sum)
        sdp.broadcast(np.ones(2), 0)
    return [len(rt._cache), len(rt._coord.cache_meta) if rt._coord else 0, float(x[0])]


def changing_shapes(steps):
    """Named collectives whose shapes change every step (a fused pair "g.0"/"g.1" sent twice per
    step, so the second time as one cached batch, and "x"): returns the sizes of this rank's
    response cache and (rank 0) the coordinator's, and whether every result was exact."""
    rt = sdp.api.runtime()
    exact = True
    for i in range(steps):
        n, m = i % 5 + 1, i % 7 + 1
        for _ in range(2):
            g = sdp.grouped_allreduce([np.full(n, i, np.float32), np.ones(3, np.float32)], name="g", op=sdp.Sum)
            exact &= g[0].shape == (n,) and bool((g[0] == 2 * i).all() and (g[1] == 2).all())
        x = sdp.allreduce(np.full(m, float(sdp.rank() + 1)), name="x", op=sdp.Sum)
        exact &= x.shape == (m,) and bool((x == 3.0).all())
    return [len(rt._cache), len(rt._coord.cache_meta) if rt._coord else 0, exact]


def killed_in_startup(job):
    """Rank 1 kills itself (SIGKILL) as soon as its shared-memory segment exists, before its
    peers mapped it; rank 0 comes late, fails to start, and returns its error type and the
    files of the job left in /dev/shm (run with init=False, SDP_JOB_ID=job)."""
    import glob
    pattern = f"/dev/shm/sdp-{job}-*"
    if sdp.api._topology.from_env().rank == 1:
        def made() -> bool:  # a /dev/shm file or a memfd of this rank (sdp.transport.shm)
            if glob.glob(f"/dev/shm/sdp-{job}-1-*"):
                return True
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:sdp-{job}-1"):
                        return True
                except OSError:
                    pass
            return False

        def suicide():
            for _ in range(20000):
                if made():
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0005)
        threading.Thread(target=suicide, daemon=True).start()
        sdp.init()
        time.sleep(30)
        return None
    time.sleep(1.0)
    try:
        sdp.init()
        return ["none", glob.glob(pattern)]
    except errors.SdpError as e:
        return [type(e).__name__, glob.glob(pattern)]


def stall(steps, quiet_s, quiet_rank):
    """``steps`` steady steps of two named allreduces on every rank (the coordinator's batch
    cache takes them), then rank ``quiet_rank`` goes quiet for ``quiet_s`` seconds (no collective at
    all) while the others submit the next step.  Returns (error type, message, seconds waited)."""
    for i in range(steps):
        [h.wait() for h in sdp.grouped_allreduce_async([np.ones(2), np.ones(3)], names=["w", "b"], op=sdp.Sum)]
    t = time.monotonic()
    try:
        if sdp.rank() == quiet_rank:
            time.sleep(quiet_s)
        [h.wait() for h in sdp.grouped_allreduce_async([np.ones(2), np.ones(3)], names=["w", "b"], op=sdp.Sum)]
        return ["none", "", time.monotonic() - t]
    except errors.SdpError as e:
        return [type(e).__name__, str(e), time.monotonic() - t]
