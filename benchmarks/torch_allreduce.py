"""PyTorch on sdp against PyTorch's Gloo, in one run: allreduce of CPU tensors and a DDP step.

Run under the launcher (2 ranks, one host)::

    sdprun -np 2 python benchmarks/torch_allreduce.py
    sdprun -np 2 python benchmarks/torch_allreduce.py --sizes 1K,1M --rounds 3
    sdprun -np 2 python benchmarks/torch_allreduce.py --device cuda --sizes 1M,64M   # a GPU (tests/gpu_run.sh)

Rank 0 prints an environment line, then one table:

- per size (default 1K, 1M, 64M; float32, SUM): the median time of one allreduce and its busbw
  (algbw * 2(n-1)/n, GB/s = 1e9 B/s) through ``sdp.torch.allreduce`` (Horovod's PyTorch API, a
  new tensor; "n/a" where ``sdp.torch`` has no ``allreduce``), ``sdp.allreduce`` (the numpy API,
  into a preallocated array), ``torch.distributed.all_reduce`` on the ``sdp`` backend
  (:mod:`sdp.torch.distributed`, in place) and on Gloo (in place, on loopback);
- the step time of DDP training a small CNN (batch 64 of 28x28 images) over the ``sdp``
  backend and over Gloo;
- PASS/FAIL against the targets below (a miss does not change the exit status).

With ``--device cuda`` the tensors are CUDA tensors on the rank's local GPU (every rank on one GPU
shares it; ``tests/gpu_run.sh`` runs this under MPS): each timed call ends with
``torch.cuda.synchronize()``, the numpy API's column and the DDP step are left out, and the
targets are the GPU ones (``sdp.torch`` 64 MB busbw, no device-to-host copy with CUDA IPC
(``sdp.device_counters()``), and Gloo on the same CUDA tensors).  A mode that raises is reported
as failed and left out of the table; the others go on.

The modes alternate: ``--rounds`` rounds, each running every mode in turn (rotated per round), so
a slow stretch of this shared machine hits each alike.  A time is the median over a round's
iterations, then the median over rounds, then the maximum over ranks.  The default group is the
``sdp`` backend on a file store in a temporary directory (``init_method="file://..."``), so that
a Gloo group (``dist.new_group(backend="gloo")``, ``GLOO_SOCKET_IFNAME=lo``) joins the same job.
"""
import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import sdp
import sdp.torch
import sdp.torch.distributed  # noqa: F401  (registers "sdp")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpbench.common import fmt_size, median_call_time, parse_size  # noqa: E402  (benchmarks/sdpbench/)

# ---- targets (issue 52; 2 ranks, one host, float32) ------------------------------------------------
TARGET_TORCH_1K_VS_NUMPY = 1.5      # sdp.torch 1 KB time <= 1.5 x the numpy API's
TARGET_TORCH_64M_BUSBW = 0.9        # sdp.torch 64 MB busbw >= 0.9 x the numpy API's
TARGET_VS_GLOO = 2.0                # sdp.torch and the numpy API >= 2 x faster than Gloo (1K, 1M, 64M)
TARGET_DDP_VS_GLOO = 1.0            # DDP step over sdp <= 1.0 x over Gloo
TARGET_CUDA_64M_BUSBW = 150.0       # a GPU: sdp.torch 64 MB busbw >= 150 GB/s (CUDA IPC, 2 ranks, one GPU)
TARGET_CUDA_VS_GLOO = 5.0           # a GPU: sdp.torch >= 5 x faster than Gloo on the same CUDA tensors at 64 MB

MODES = ("sdp.torch", "numpy API", "dist sdp", "dist gloo")


def log0(*args) -> None:
    if sdp.rank() == 0:
        print(*args, flush=True)


def max_over_ranks(x: float) -> float:
    return float(sdp.allreduce(np.array([x], np.float64), name="bench.max", op=sdp.Max)[0])


def iterations(nbytes: int) -> int:
    return 200 if nbytes <= 64 << 10 else 40 if nbytes <= 4 << 20 else 6


def callers(nbytes: int, gloo, device: str = "cpu"):
    """{mode: a function that runs one allreduce of ``nbytes`` float32 on ``device``}, or None
    where absent (on CUDA each call waits for the device: ``torch.cuda.synchronize()``)."""
    n = nbytes // 4
    t_in, t_sdp, t_gloo = (torch.ones(n, device=device), torch.zeros(n, device=device),
                           torch.zeros(n, device=device))  # (in place: zeros stay finite)
    a_in, a_out = np.ones(n, np.float32), np.empty(n, np.float32)
    name = f"bench.{fmt_size(nbytes)}"
    has_face = hasattr(sdp.torch, "allreduce")
    calls = {
        "sdp.torch": (lambda: sdp.torch.allreduce(t_in, name=name + ".torch", op=sdp.torch.Sum)) if has_face else None,
        "numpy API": ((lambda: sdp.allreduce(a_in, name=name + ".np", op=sdp.Sum, out=a_out))
                      if device == "cpu" else None),
        "dist sdp": lambda: dist.all_reduce(t_sdp),
        "dist gloo": lambda: dist.all_reduce(t_gloo, group=gloo),
    }
    if device == "cpu":
        return calls
    return {m: None if f is None else (lambda f=f: (f(), torch.cuda.synchronize())) for m, f in calls.items()}


def build_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(16 * 12 * 12, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def ddp_steps(group):
    """A function running one DDP training step of the small CNN over ``group`` (None: the default
    group, the sdp backend)."""
    model = torch.nn.parallel.DistributedDataParallel(build_cnn(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(sdp.rank())
    x, y = torch.randn(64, 1, 28, 28, generator=gen), torch.randint(0, 10, (64,), generator=gen)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def env_line(n: int) -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"env: host={platform.node()} cores={os.cpu_count()} load=[{load}] python={platform.python_version()} "
            f"torch={torch.__version__} numpy={np.__version__} sdp={sdp.__version__} world_size={n} "
            f"torch threads={torch.get_num_threads()} sdp.torch.allreduce="
            f"{'yes' if hasattr(sdp.torch, 'allreduce') else 'absent (not on this checkout)'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1K,1M,64M", help="message sizes (binary units), float32")
    p.add_argument("--rounds", type=int, default=5, help="rounds of alternating modes")
    p.add_argument("--ddp-steps", type=int, default=10, help="timed DDP steps per mode per round")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the tensors are (cuda: the rank's local GPU; GPU targets, no DDP step)")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(f"torch_allreduce.py: --device cuda: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2

    if not sdp.is_initialized():
        sdp.init()
    rank, n = sdp.rank(), sdp.size()
    if cuda:
        torch.cuda.set_device(sdp.local_rank() % torch.cuda.device_count())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sdp.local_size()))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the baseline on loopback only
    tmp = sdp.broadcast_object(tempfile.mkdtemp(prefix="sdp_torch_bench_") if rank == 0 else None, 0)
    dist.init_process_group(backend="sdp", init_method=f"file://{tmp}/store", rank=rank, world_size=n)
    gloo = dist.new_group(backend="gloo")
    factor = 2.0 * (n - 1) / n

    log0(env_line(n))
    log0("The machine is shared: other processes skew every figure; compare columns of one run.")
    results, failed = {}, {}  # (size, mode) -> [seconds per round]; (size, mode) -> what it raised
    d2h = {}  # a GPU: size -> bytes sdp.torch's calls copied device-to-host after the first round
    for size in sizes:
        calls = callers(size, gloo, args.device)
        modes = [m for m in MODES if calls[m] is not None]
        for r in range(args.rounds):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                if (size, mode) in failed:
                    continue
                counted = cuda and mode == "sdp.torch" and r > 0  # (the first round opens the IPC windows)
                before = sdp.device_counters()["d2h"] if counted else 0
                try:
                    results.setdefault((size, mode), []).append(median_call_time(calls[mode], iterations(size)))
                except Exception as e:  # (reported below; the other modes go on)
                    failed[(size, mode)] = f"{type(e).__name__}: {e}"
                    results.pop((size, mode), None)
                if counted:
                    d2h[size] = d2h.get(size, 0) + sdp.device_counters()["d2h"] - before
    if not cuda:
        ddp = {"DDP sdp": ddp_steps(None), "DDP gloo": ddp_steps(gloo)}
        for r in range(args.rounds):
            for mode in (list(ddp) if r % 2 == 0 else list(ddp)[::-1]):
                results.setdefault(("ddp", mode), []).append(median_call_time(ddp[mode], args.ddp_steps))
    t = {k: max_over_ranks(statistics.median(v)) for k, v in sorted(results.items(), key=lambda kv: str(kv[0]))}

    head = f"{'size':>6}" + "".join(f" {m + ' us':>14} {'busbw':>7}" for m in MODES)
    where = "CUDA tensors, " if cuda else ""
    log0(f"\nallreduce, {where}float32 SUM, {n} ranks, median of {args.rounds} alternating rounds (GB/s = 1e9 B/s)")
    log0(head)
    for size in sizes:
        cells = []
        for m in MODES:
            s = t.get((size, m))
            cells.append(f" {'n/a':>14} {'':>7}" if s is None else f" {s * 1e6:>14.1f} {size / s * factor / 1e9:>7.3f}")
        log0(f"{fmt_size(size):>6}" + "".join(cells))
    for (size, mode), why in sorted(failed.items()):
        log0(f"{fmt_size(size)} {mode}: failed ({why})")
    if not cuda:
        ddp_sdp, ddp_gloo = t[("ddp", "DDP sdp")], t[("ddp", "DDP gloo")]
        log0(f"\nDDP step (small CNN, batch 64 per rank): sdp backend {ddp_sdp * 1e3:.2f} ms, "
             f"Gloo {ddp_gloo * 1e3:.2f} ms, "
             f"ratio {ddp_sdp / ddp_gloo:.2f}")

    log0(f"\ntargets ({n} ranks, one host{', one GPU' if cuda else ''}):")

    def check(label, ok, detail):
        log0(f"  {'PASS' if ok else 'FAIL'}  {label}: {detail}")

    def ratio(a, b):
        return None if a is None or b is None else a / b
    one_k, one_m, big = 1 << 10, 1 << 20, 64 << 20
    if cuda:
        gpu_targets(t, d2h, factor, check)
        return finish(tmp, rank)
    if one_k in sizes and t.get((one_k, "sdp.torch")) is not None:
        q = ratio(t[(one_k, "sdp.torch")], t[(one_k, "numpy API")])
        check(f"sdp.torch 1 KB <= {TARGET_TORCH_1K_VS_NUMPY}x numpy API", q <= TARGET_TORCH_1K_VS_NUMPY, f"{q:.2f}x")
    if big in sizes and t.get((big, "sdp.torch")) is not None:
        q = ratio(t[(big, "numpy API")], t[(big, "sdp.torch")])
        check(f"sdp.torch 64 MB busbw >= {TARGET_TORCH_64M_BUSBW}x numpy API", q >= TARGET_TORCH_64M_BUSBW, f"{q:.2f}x")
    for size in (one_k, one_m, big):
        if size not in sizes:
            continue
        for m in ("sdp.torch", "numpy API", "dist sdp"):
            if t.get((size, m)) is not None:
                q = ratio(t[(size, "dist gloo")], t[(size, m)])
                check(f"{m} {fmt_size(size)} >= {TARGET_VS_GLOO}x faster than Gloo", q >= TARGET_VS_GLOO, f"{q:.2f}x")
    q = ddp_sdp / ddp_gloo
    check(f"DDP step over sdp <= {TARGET_DDP_VS_GLOO}x over Gloo", q <= TARGET_DDP_VS_GLOO, f"{q:.2f}x")
    if not hasattr(sdp.torch, "allreduce"):
        log0("  n/a   sdp.torch.allreduce targets: sdp.torch has no allreduce on this checkout")
    return finish(tmp, rank)


def gpu_targets(t: dict, d2h: dict, factor: float, check) -> None:
    """The GPU targets (``--device cuda``) from the table's times ``t`` and the bytes copied
    device-to-host per size ``d2h``."""
    big = 64 << 20
    s, g = t.get((big, "sdp.torch")), t.get((big, "dist gloo"))
    if s is None:
        log0("  n/a   the 64 MB targets: no sdp.torch time at 64 MB (--sizes, or it failed)")
        return
    bw = big / s * factor / 1e9
    check(f"sdp.torch 64 MB busbw >= {TARGET_CUDA_64M_BUSBW:.0f} GB/s", bw >= TARGET_CUDA_64M_BUSBW, f"{bw:.1f} GB/s")
    if g is not None:
        check(f"sdp.torch 64 MB >= {TARGET_CUDA_VS_GLOO}x faster than Gloo (CUDA tensors)",
              g / s >= TARGET_CUDA_VS_GLOO, f"{g / s:.2f}x")
    copied = max_over_ranks(float(d2h.get(big, 0)))
    ipc = bool(sdp.device_counters().get("ipc"))
    check("sdp.torch 64 MB: no device-to-host copy (CUDA IPC)", ipc and copied == 0,
          f"{copied:.0f} bytes copied, CUDA IPC {'on' if ipc else 'off'}")


def finish(tmp: str, rank: int) -> int:
    dist.destroy_process_group()
    sdp.barrier()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
