"""The baselines of ``benchmarks/allreduce.py``, measured in the same run: TensorFlow's
``MultiWorkerMirroredStrategy`` ring (``_tf_baseline.py``, 2 workers started by ranks 0 and 1
after sdp's measurements), and whether a real Horovod is installed."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import sdp
from sdp.launcher.cli import STREAMING_COPIES
from sdpbench.common import HERE


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
