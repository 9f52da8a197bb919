"""One rank of a job started by a cluster's own means (``mpirun``, ``srun``, replayed pod /
instance environments): ``sdp.init()`` from the environment alone, allreduces checked against
numpy, then one line ``ROW {json}`` with the rank's place, its host name, the topology's source and
rendezvous, ``SDP_RANK``, the pids whose command line holds ``SDP_SECRET`` and Slurm's job/step ids.

``workers_cluster.py FAULT_DIR`` (fault tests): SIGTERM is ignored (the launcher's SIGTERM to the
survivors must not come before their report), the rank writes ``FAULT_DIR/RANK.json`` (its pid
and Slurm job id) after the ROW line, then allreduces for up to 60 s; on ``PeerLostError`` it
prints ``LOST rank=R at=UNIX_TIME`` and exits 3."""
import json
import os
import signal
import socket
import sys
import time

import numpy as np

import sdp
from sdp.common import topology
from sdp.common.errors import PeerLostError

fault_dir = sys.argv[1] if len(sys.argv) > 1 else None
if fault_dir:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sdp.init()
r, n = sdp.rank(), sdp.size()
for count in (0, 7, 300_001):
    x = (np.arange(count) % 13 + r).astype(np.float32)
    got = sdp.allreduce(x, op=sdp.Sum, name=f"ar{count}")
    assert np.array_equal(got, sum((np.arange(count) % 13 + q).astype(np.float32) for q in range(n)))
secret = os.environ.get("SDP_SECRET", "")
in_argv = []
for p in os.listdir("/proc") if secret else ():
    try:
        if p.isdigit() and secret.encode() in open(f"/proc/{p}/cmdline", "rb").read():
            in_argv.append(p)
    except OSError:  # ended meanwhile
        pass
t = topology.from_env()
print("ROW " + json.dumps({"rank": r, "size": n, "local": [sdp.local_rank(), sdp.local_size()],
                           "cross": [sdp.cross_rank(), sdp.cross_size()], "host": socket.gethostname(),
                           "source": t.source, "rendezvous": t.rendezvous_addr,
                           "sdp_rank": os.environ.get("SDP_RANK"), "secret_in_argv": in_argv,
                           "job": os.environ.get("SLURM_JOB_ID"), "step": os.environ.get("SLURM_STEP_ID")}),
      flush=True)
if fault_dir:
    with open(os.path.join(fault_dir, f"{r}.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID")}, f)
    os.replace(os.path.join(fault_dir, f"{r}.tmp"), os.path.join(fault_dir, f"{r}.json"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sdp.allreduce(np.ones(1000, np.float32), op=sdp.Sum, name="step")
            time.sleep(0.01)
    except PeerLostError as e:
        print(f"LOST rank={e.rank} at={time.time():.3f}", flush=True)
        sys.exit(3)
sdp.shutdown()
