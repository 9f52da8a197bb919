"""LeNet-5 step time on KungFu's MindSpore face: 1 vs 2 ranks, per-gradient vs grouped allreduce.

    python benchmarks/mindspore_step.py              # runs sdprun itself, prints the table
    python benchmarks/mindspore_step.py --steps 100 --batch-size 32

Needs MindSpore (the ``mindspore`` extra, numpy<2).  For each configuration it starts
``sdprun --compat kungfu -np N python benchmarks/mindspore_step.py --worker ...``: every rank
trains LeNet-5 (GRAPH mode, ``TrainOneStepCell``) on synthetic 1x32x32 images, the same batch
size per rank, with ``KungFuMomentum`` (one allreduce per gradient, 10 per step, through
``C.Map``) or ``KungFuGroupedMomentum`` (all gradients in one request, fused by the engine);
the 1-rank rows use the same optimizers on a cluster of one.  A step is timed from its call to
its loss being read; the table shows the median over ``--steps`` steps after ``--warmup``,
maximum over ranks, and the ratio to the 1-rank step of the same optimizer.  Target: the 2-rank
grouped step at most 1.3x the 1-rank step.  Each rank is pinned to its own cores
(``--cores-per-rank``, default half the machine), the lone rank of the 1-rank run too, so both
runs give a rank the same compute and the ratio measures communication, not two ranks sharing
cores (on 2 cores an unpinned 1-rank step uses both).  Load on the machine skews every number: the first
line gives the load average.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "@@STEP@@"


def worker(args):
    if args.cores_per_rank:  # before MindSpore starts its thread pool: this rank's own cores
        local = int(os.environ.get("SDP_LOCAL_RANK", "0"))
        first = local * args.cores_per_rank % os.cpu_count()
        os.sched_setaffinity(0, set(range(first, min(first + args.cores_per_rank, os.cpu_count()))))
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from mindspore_lenet_elastic import LeNet5
    from mindspore.nn.optim.kungfu import KungFuGroupedMomentum, KungFuMomentum
    from mindspore.ops.operations.kungfu_comm_ops import KungFuAllGather
    from mindspore._c_expression import kungfu_current_rank

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(1)
    net = LeNet5()
    cls = KungFuGroupedMomentum if args.optimizer == "grouped" else KungFuMomentum
    opt = cls(net.trainable_params(), 0.01, 0.9)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")),
                               opt)
    rng = np.random.default_rng(kungfu_current_rank())
    x = ms.Tensor(rng.standard_normal((args.batch_size, 1, 32, 32)).astype(np.float32))
    y = ms.Tensor(rng.integers(0, 10, args.batch_size).astype(np.int32))
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step(x, y).asnumpy()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = ms.Tensor(np.float64(statistics.median(times)))
    every = KungFuAllGather()(med).asnumpy()
    if kungfu_current_rank() == 0:
        print(MARK + json.dumps({"median_s": float(every.max())}), flush=True)


def run(n, optimizer, args):
    env = dict(os.environ, GLOG_v="3", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "sdp.launcher.cli", "--compat", "kungfu", "-np", str(n), sys.executable,
           os.path.abspath(__file__), "--worker", "--optimizer", optimizer, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
           "--cores-per-rank", str(args.cores_per_rank)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    m = re.search(re.escape(MARK) + r"(\{.*\})", p.stdout)
    return json.loads(m.group(1))["median_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", choices=("per-gradient", "grouped"), default="grouped")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--target", type=float, default=1.3)
    ap.add_argument("--cores-per-rank", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="cores each rank is pinned to, in the 1-rank run too (0: no pinning); default: "
                         "half the machine, so both runs give every rank the same cores")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import mindspore
    print(f"cores {os.cpu_count()} ({args.cores_per_rank or 'all'} per rank), load {os.getloadavg()[0]:.2f}, "
          f"mindspore {mindspore.__version__}, batch {args.batch_size}/rank, {args.steps} steps after {args.warmup}",
          flush=True)
    print(f"{'optimizer':<14}{'1 rank (ms)':>12}{'2 ranks (ms)':>14}{'2/1':>7}")
    ratios = {}
    for optimizer in ("per-gradient", "grouped"):
        one, two = run(1, optimizer, args), run(2, optimizer, args)
        ratios[optimizer] = two / one
        print(f"{optimizer:<14}{one * 1e3:>12.2f}{two * 1e3:>14.2f}{two / one:>7.2f}", flush=True)
    ok = ratios["grouped"] <= args.target
    print(f"{'PASS' if ok else 'FAIL'}: 2-rank grouped step {ratios['grouped']:.2f}x the 1-rank step "
          f"(target <= {args.target}x)")


if __name__ == "__main__":
    main()
