"""Worker functions (and the intruder) of tests/test_security.py: run in real worker processes."""
import json
import os
import stat
import subprocess
import sys
import time

import numpy as np

import sdp

# The intruder: a separate process that knows every endpoint of the job but not its secret.
# For each endpoint and each claimed sender rank it tries four ways in (no security at all,
# CURVE with keys of a wrong secret, CURVE with the job's server public key (leaked) but its own
# client key, PLAIN with a guessed token) and sends a well-formed ABORT
# (which, accepted, would stop the job) and a well-formed DATA message.
INTRUDER = r"""
import json, struct, sys, time
import zmq
from sdp.transport import security
from sdp.transport.zmq_mesh import ABORT, DATA, HEADER, MAGIC
endpoints, ranks, server_public = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3].encode()
ctx = zmq.Context()
socks = []
for ep in endpoints:
    for claimed in ranks:
        for how in ("none", "wrong-secret", "leaked-server-key", "guessed-token"):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.ROUTING_ID, struct.pack("<I", claimed))
            if how == "wrong-secret":
                security.secure_client(d, security.new_secret())
            elif how == "leaked-server-key":
                d.curve_serverkey = server_public
                d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()
            elif how == "guessed-token":
                security.secure_client(d, None, str(claimed), "0" * 32)
            d.setsockopt(zmq.SNDTIMEO, 1000)  # the refused connection may be gone already: never block
            d.connect(ep)
            try:
                d.send_multipart([HEADER.pack(MAGIC, ABORT, 0, 0),
                                  json.dumps({"lost": claimed, "err": "intruder says stop"}).encode()])
                d.send_multipart([HEADER.pack(MAGIC, DATA, 0, 1), b"\x01" * 64])
            except zmq.Again:
                pass
            socks.append(d)
time.sleep(1.0)  # let every handshake fail (and reconnects be tried)
for d in socks:
    d.close(linger=0)
ctx.term()
print("intruder done", len(socks))
"""


def _stray(mesh) -> int:
    """Messages in the inbox that no job rank sent: from this rank itself, from a rank outside
    the job, or DATA/ABORT left over after the last collective (a peer's BYE may be there)."""
    from sdp.transport.zmq_mesh import ABORT, DATA
    return sum(len(q) for (src, kind), q in mesh.inbox.items()
               if src == mesh.rank or not 0 <= src < mesh.size or kind in (DATA, ABORT))


def _listening():
    """(ip, port) of every TCP socket this process listens on."""
    import psutil
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def mesh_server_public(mesh) -> str:
    from sdp.transport import security
    return security.job_keys(mesh._secret).server_public.decode()


def attacked_job(intruder_env):
    """Rank 0 starts the intruder against every rank's tcp and ipc endpoint while rank 1 waits in
    a collective; then every rank checks its result and that nothing foreign got through."""
    mesh = sdp.api.runtime().mesh
    out = {}
    if sdp.rank() == 0:
        endpoints = [ep for p in mesh.peers for ep in (p["endpoints"]["tcp"], p["endpoints"]["ipc"])]
        env = {k: v for k, v in os.environ.items() if k not in ("SDP_SECRET", "SDP_SECRET_FILE")}
        env.update(intruder_env)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", INTRUDER, json.dumps(endpoints),
                            json.dumps(list(range(sdp.size())) + [sdp.size(), 2 ** 31]),
                            mesh_server_public(mesh)],
                           env=env, capture_output=True, text=True, timeout=30)
        out["intruder"] = [p.returncode, p.stdout.strip(), p.stderr[-2000:], time.monotonic() - t0]
    x = np.arange(1000, dtype=np.float32) * (sdp.rank() + 1)
    res = sdp.allreduce(x, name="after_intruder", op=sdp.Sum)
    res2 = sdp.allreduce(x, name="after_intruder_2", op=sdp.Sum)
    out["ok"] = bool(np.array_equal(res, np.arange(1000, dtype=np.float32) * 3) and np.array_equal(res, res2))
    out["aborted"] = {str(k): v for k, v in mesh.aborted.items()}
    out["stray"] = _stray(mesh)
    out["refused_by_gatekeeper"] = mesh._gate.rejected
    out["listening"] = _listening()
    out["ipc_dir_mode"] = _ipc_mode(mesh)
    out["encrypt"] = mesh.encrypt
    return out


def _ipc_mode(mesh):
    """"abstract" for a Linux abstract ipc socket (no file at all), else its directory's mode."""
    if mesh.endpoints["ipc"].startswith("ipc://@"):
        return "abstract"
    return oct(stat.S_IMODE(os.stat(mesh._ipc_dir).st_mode))


def listening_and_modes(_):
    """Every listening TCP socket and the modes of this rank's ipc directory and shared memory."""
    mesh = sdp.api.runtime().mesh
    shm_mode = None
    seg = mesh.shm or mesh.host_shm
    if seg is not None and os.path.exists(seg.path):
        shm_mode = oct(stat.S_IMODE(os.stat(seg.path).st_mode))
    x = sdp.allreduce(np.ones(4, np.float32), name="modes", op=sdp.Sum)
    return {"listening": _listening(), "ipc_dir_mode": _ipc_mode(mesh),
            "shm_mode": shm_mode, "sum": float(x[0])}



def late_init(delays):
    """sdp.init() after ``delays[rank]`` seconds, then one allreduce."""
    time.sleep(delays[int(os.environ["RANK"])])
    sdp.init()
    x = sdp.allreduce(np.full(8, sdp.rank() + 1.0, np.float32), name="late", op=sdp.Sum)
    return [sdp.rank(), sdp.size(), float(x[0])]


def claims_own_rank(_):
    """A process holding the secret (this rank itself, over CURVE) sends this rank a well-formed
    DATA message that claims to come from this very rank: the mesh drops and logs it."""
    import zmq
    from sdp.transport import security
    from sdp.transport.zmq_mesh import DATA, HEADER, MAGIC
    mesh = sdp.api.runtime().mesh
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 1000)
    d.setsockopt(zmq.ROUTING_ID, (sdp.rank()).to_bytes(4, "little"))
    security.secure_client(d, mesh._secret)
    d.connect(mesh.endpoints["tcp"])
    d.send_multipart([HEADER.pack(MAGIC, DATA, 0, 1), b"\x07" * (1 << 20)])
    time.sleep(0.3)
    d.close()
    ctx.term()
    x = sdp.allreduce(np.ones(4, np.float32), name="after_self_claim", op=sdp.Sum)
    mesh.pump(100)
    return {"sum": float(x[0]), "stray": _stray(mesh)}
