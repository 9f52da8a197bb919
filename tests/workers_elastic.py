"""Worker of tests/test_elastic_mp.py: Horovod Elastic's loop on numpy (sdp.api + sdp.elastic).

Each step allreduces (SUM) a vector of ones and adds the step number to ``state.done``; a commit
every ``COMMIT`` steps.  ``DIE_WORKER``/``DIE_STEP``: that worker kills itself (SIGKILL) at that
step, after its allreduce was submitted; ``HANG_WORKER`` never asks to re-form after a failure;
``WAIT_STEP``/``WAIT_FILE``: rank 0 prints ``WAITING`` at that step and goes on once the file exists;
``PROGRESS=1``: a ``PROGRESS`` line per step; ``STOP_FILE``: once it exists (rank 0 looks before each
step and tells the others in that step's allreduce), every rank ends after that same step instead of
at ``STEPS`` (tests write it once what they check has happened).  At the end every rank prints its
size, the checksum of ``state.value`` and whether its steps were 0..(last step) once each.
"""
import functools
import os
import signal
import sys
import time

import numpy as np

from sdp import api, elastic
from sdp.common.reduce_ops import ReduceOp

STEPS = int(os.environ.get("STEPS", "40"))
COMMIT = int(os.environ.get("COMMIT", "5"))
DIE_WORKER = os.environ.get("DIE_WORKER")
DIE_STEP = int(os.environ.get("DIE_STEP", "-1"))
STEP_S = float(os.environ.get("STEP_S", "0.05"))
WAIT_STEP = int(os.environ.get("WAIT_STEP", "-1"))  # rank 0 prints WAITING there and waits for WAIT_FILE
WAIT_FILE = os.environ.get("WAIT_FILE")
PROGRESS = bool(os.environ.get("PROGRESS"))  # a PROGRESS line per step (tests act on them)
STOP_FILE = os.environ.get("STOP_FILE")

api.init()
state = elastic.ObjectState(step=0, done=[], value=0.0, sizes=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(api.size())])


def hang():  # HANG_WORKER: this worker never asks to re-form
    time.sleep(3600)


@functools.partial(elastic.run_fn, reset_fn=hang if os.environ.get(elastic.WORKER_ENV) == os.environ.get("HANG_WORKER")
                   else elastic.reset)
def train(state):
    while state.step < STEPS:
        if os.environ.get(elastic.WORKER_ENV) == DIE_WORKER and state.step == DIE_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step == WAIT_STEP and api.rank() == 0 and WAIT_FILE and not os.path.exists(WAIT_FILE):
            print("WAITING", flush=True)  # (the others wait in the next allreduce)
            while not os.path.exists(WAIT_FILE):
                time.sleep(0.05)
        stop = float(api.rank() == 0 and bool(STOP_FILE) and os.path.exists(STOP_FILE))
        out = api.allreduce(np.array([1, 1, 1, 1, stop], np.float32), name=f"step.{state.step}", op=ReduceOp.SUM)
        assert out[0] == api.size(), (out, api.size())
        state.value += float(out[0])
        state.done.append(state.step)
        state.sizes.append(api.size())
        state.step += 1
        if PROGRESS:
            print(f"PROGRESS worker={os.environ.get(elastic.WORKER_ENV)} rank={api.rank()} size={api.size()} "
                  f"step={state.step} host={os.environ.get('SDP_HOSTNAME')} pid={os.getpid()} job={os.environ.get('SDP_JOB_ID')}",
                  flush=True)
        if out[4]:  # rank 0 saw STOP_FILE: every rank ends after this same step
            break
        time.sleep(STEP_S)
        if state.step % COMMIT == 0:
            state.commit()
    return state


train(state)
print(f"RESULT rank={api.rank()} size={api.size()} epoch={elastic.epoch()} value={state.value} "
      f"resets={resets} done_ok={state.done == list(range(state.step))} sizes={sorted(set(state.sizes))}", flush=True)
api.shutdown()
sys.exit(0)
