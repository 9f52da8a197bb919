"""One rank of a job started by a cluster's own means (replayed pod / instance environments):
``sdp.init()`` from the environment alone, allreduces checked against numpy, then one line
``ROW {json}`` with the rank's place, its host name and the topology's source and rendezvous."""
import json
import socket

import numpy as np

import sdp
from sdp.common import topology

sdp.init()
r, n = sdp.rank(), sdp.size()
for count in (0, 7, 300_001):
    x = (np.arange(count) % 13 + r).astype(np.float32)
    got = sdp.allreduce(x, op=sdp.Sum, name=f"ar{count}")
    assert np.array_equal(got, sum((np.arange(count) % 13 + q).astype(np.float32) for q in range(n)))
t = topology.from_env()
print("ROW " + json.dumps({"rank": r, "size": n, "local": [sdp.local_rank(), sdp.local_size()],
                           "cross": [sdp.cross_rank(), sdp.cross_size()], "host": socket.gethostname(),
                           "source": t.source, "rendezvous": t.rendezvous_addr}), flush=True)
sdp.shutdown()
