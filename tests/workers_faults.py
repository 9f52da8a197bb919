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
