"""Point to point: ``sdp.send``/``sdp.recv`` between ranks 0 and 1 against PyTorch's Gloo
``send``/``recv`` (when torch is installed), in one run.

Run under the launcher (2 ranks, one host)::

    sdprun -np 2 python benchmarks/p2p.py
    sdprun -np 2 python benchmarks/p2p.py --sizes 1K,4M --rounds 3

Rank 0 prints one table: per size (float32), the median round trip of a ping-pong (rank 0 sends,
rank 1 sends the same bytes back; us) and the bandwidth it implies (bytes each way / half the
round trip, GB/s = 1e9 B/s), for sdp and for Gloo on loopback.  The modes alternate: ``--rounds``
rounds, each running every mode in turn; a time is the median over a round's iterations, then
the median over rounds.  No target: a table to compare (``benchmarks/README.md``).
"""
import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

import sdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpbench.common import fmt_size, median_call_time, parse_size  # noqa: E402  (benchmarks/sdpbench/)


def ping_pong_sdp(nbytes: int):
    x, y = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    r = sdp.rank()

    def once():
        if r == 0:
            sdp.send(x, 1).wait()
            sdp.recv(y, 1).wait()
        elif r == 1:
            sdp.recv(y, 0).wait()
            sdp.send(y, 0).wait()
    return once


def ping_pong_gloo(nbytes: int, group):
    import torch
    import torch.distributed as dist
    x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    r = sdp.rank()

    def once():
        if r == 0:
            dist.send(x, 1, group=group)
            dist.recv(y, 1, group=group)
        elif r == 1:
            dist.recv(y, 0, group=group)
            dist.send(y, 0, group=group)
    return once


def gloo_group():
    """A Gloo process group of the job on loopback, or None without torch."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tmp = sdp.broadcast_object(tempfile.mkdtemp(prefix="sdp_p2p_bench_") if sdp.rank() == 0 else None, 0)
    dist.init_process_group(backend="gloo", init_method=f"file://{tmp}/store", rank=sdp.rank(),
                            world_size=sdp.size())
    return dist.group.WORLD


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1K,1M,64M", help="message sizes (binary units), float32")
    p.add_argument("--rounds", type=int, default=5, help="rounds of alternating modes")
    args = p.parse_args(argv)
    sdp.init()
    if sdp.size() < 2:
        print("p2p.py: needs 2 ranks (sdprun -np 2)", file=sys.stderr)
        return 2
    group = gloo_group()
    t = {}
    for size in (parse_size(s) for s in args.sizes.split(",")):
        modes = {"sdp": ping_pong_sdp(size)}
        if group is not None:
            modes["gloo"] = ping_pong_gloo(size, group)
        iters = 200 if size <= 64 << 10 else 20 if size <= 4 << 20 else 4
        for r in range(args.rounds):
            for m in list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]:
                t.setdefault((size, m), []).append(median_call_time(modes[m], iters))
        sdp.barrier()
    if sdp.rank() == 0:
        print(f"ping-pong between ranks 0 and 1 of {sdp.size()}, float32, median of {args.rounds} alternating rounds")
        print(f"{'size':>6} {'sdp us':>10} {'GB/s':>7} {'gloo us':>10} {'GB/s':>7}")
        for size in sorted({k[0] for k in t}):
            cells = []
            for m in ("sdp", "gloo"):
                v = t.get((size, m))
                cells.append(f"{'n/a':>10} {'':>7}" if v is None else
                             f"{statistics.median(v) * 1e6:>10.1f} {size / (statistics.median(v) / 2) / 1e9:>7.3f}")
            print(f"{fmt_size(size):>6} " + " ".join(cells), flush=True)
    if group is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
    sdp.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
