"""K-FAC vs. first-order optimizers on Fashion-MNIST at a large global batch, over sdp.

    python benchmarks/kfac.py                      # 16 minutes on 2 shared cores at load 2-6
    python benchmarks/kfac.py --target '' --scaling-np 1,2   # the time-per-step table only
    python benchmarks/kfac.py --np 2 --target 0.8,0.85 --max-steps 300 --scaling-np 1,2,3,4 --scaling-inv-every 1

Runs ``examples/kfac_mnist.py`` under ``sdprun`` (one job per row) and prints two tables:

1. *Steps to target*: with ``--np`` ranks and global batch ``--batch-size`` (default 1080), the
   steps and wall time each optimizer needs to reach each ``--target`` test accuracy (checked
   every ``--eval-every`` steps, and every step while within ``--eval-near`` below a target not
   reached yet, so the steps are exact; wall time includes the evaluations; the same rule for every
   row): K-FAC with both strategies (the example's defaults), SGD with momentum 0.9 and Adam, each
   with a small learning-rate sweep; a line warns where a first-order sweep's best learning rate is
   at its edge.  Every run uses the same model, batch, cosine schedule over ``--max-steps`` and seed.  The lines
   under the table compare K-FAC's steps with the best first-order run (target: <= 0.5x); where
   no first-order run got there within the budget, the ratio is an upper bound, steps / budget.
2. *Time per step*: K-FAC (both strategies) for ``--scaling-steps`` steps on each world size of
   ``--scaling-np``, refreshing the inverses every ``--scaling-inv-every`` steps, split into
   gradient (forward, backward, preconditioning, update), factor, inverse and communication, in ms
   per step.  ``inverse`` is given as the maximum and the mean over the ranks, in wall time and in
   the CPU time of the inverting thread (``cpu``): with ``chief`` rank 0 inverts every factor, with
   ``split`` each rank its column blocks of the factors' inverses (``kfac.inverse_tasks``).  With
   more ranks than cores, split's ranks invert at the same time and share the cores, so its wall
   time grows; the CPU time does not.

The machine's load average is printed first; other processes on it skew every time.  A missed
target is printed as MISS; it does not change the exit status.
"""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kfac_mnist.py"
FASHION = (ROOT / ".." / "shared" / "data" / "fashion-mnist").resolve()
TIMINGS = ("gradient", "factor", "inverse", "communication")
STEPS_TARGET = 0.5  # K-FAC steps / best first-order steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=str(FASHION), help="Fashion-MNIST IDX files (default: %(default)s)")
    p.add_argument("--np", type=int, default=2, help="ranks for the steps-to-target table")
    p.add_argument("--batch-size", type=int, default=1080, help="global batch (>= 1024 for the issue's target)")
    p.add_argument("--target", default="0.8,0.85",
                   help="comma-separated test accuracies; each run stops at the highest ('' skips the table)")
    p.add_argument("--max-steps", type=int, default=300, help="step budget (and cosine decay length) per run")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-near", type=float, default=0.05,
                   help="evaluate every step while the test accuracy is within this much below a target "
                        "not reached yet, so steps to target are exact (the same rule for every row)")
    p.add_argument("--kfac-lr", default="0.1,0.3", help="comma-separated K-FAC learning rates")
    p.add_argument("--sgd-lr", default="0.02,0.05,0.1", help="comma-separated SGD-momentum learning rates")
    p.add_argument("--adam-lr", default="0.008,0.016,0.032,0.064,0.128",
                   help="comma-separated Adam learning rates")
    p.add_argument("--scaling-np", default="1,2,3,4", help="world sizes for the time-per-step table ('' skips it)")
    p.add_argument("--scaling-steps", type=int, default=20)
    p.add_argument("--scaling-inv-every", type=int, default=1,
                   help="inverse refresh interval in the time-per-step runs (1: every step, so the first "
                        "call's set-up cost is spread over many inversions)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    return p.parse_args(argv)


def run_example(n, args, extra):
    """One sdprun job; returns {"steps", "wall", "accuracy", "curve": [(step, accuracy, seconds)],
    "timings": {rank: {name: s/step}}}."""
    cmd = [sys.executable, "-m", "sdp.launcher.cli", "-np", str(n), sys.executable, str(EXAMPLE),
           "--data-dir", args.data_dir, "--batch-size", str(args.batch_size)] + extra
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    out = p.stdout
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{out[-2000:]}\n{p.stderr[-2000:]}")
    steps = re.search(r"steps: (\d+), wall time: ([0-9.]+) s", out)
    acc = re.search(r"test accuracy: ([0-9.]+)", out)
    sums = set(re.findall(r"weights checksum: (\w+)", out))
    if not (steps and acc) or len(sums) != 1:
        raise RuntimeError(f"unexpected output of {' '.join(cmd)} (checksums {sums}):\n{out[-2000:]}")
    curve = [(int(a), float(b), float(c)) for a, b, c in
             re.findall(r"step (\d+): loss [0-9.naninf]+, test accuracy ([0-9.]+), ([0-9.]+) s", out)]
    timings = {}
    for r, body in re.findall(r"\[(\d+)\]<stdout>:time per step \(s\): (.*)", out):
        timings[int(r)] = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", body)}
    return {"steps": int(steps.group(1)), "wall": float(steps.group(2)), "accuracy": float(acc.group(1)),
            "curve": curve, "timings": timings}


def first_reach(curve, target):
    """(step, seconds) of the first evaluation at or above ``target``, or None."""
    return next(((s, t) for s, a, t in curve if a >= target), None)


def steps_to_target(args):
    targets = sorted(float(t) for t in args.target.split(",") if t)
    if not targets:
        return
    runs = [("kfac", s, float(lr)) for s in ("chief", "split") for lr in args.kfac_lr.split(",")]
    runs += [("sgd-momentum", "", float(lr)) for lr in args.sgd_lr.split(",")]
    runs += [("adam", "", float(lr)) for lr in args.adam_lr.split(",")]
    print(f"\nsteps (and wall s) to test accuracy {', '.join(map(str, targets))} on {Path(args.data_dir).name}, "
          f"{args.np} ranks, global batch {args.batch_size}, budget {args.max_steps} steps (evaluated every "
          f"{args.eval_every} steps, every step within {args.eval_near} below a target; a run stops at "
          f"{targets[-1]})")
    print(f"{'optimizer':<14} {'strategy':<8} {'lr':>7} " + " ".join(f"{'@' + str(t):>15}" for t in targets)
          + f" {'last acc':>9}")
    results = []
    for opt, strategy, lr in runs:
        extra = ["--optimizer", opt, "--lr", str(lr), "--steps", str(args.max_steps),
                 "--eval-every", str(args.eval_every), "--eval-near", str(args.eval_near),
                 "--target-accuracy", ",".join(map(str, targets))]
        if strategy:
            extra += ["--strategy", strategy]
        r = run_example(args.np, args, extra)
        r.update(optimizer=opt, strategy=strategy, lr=lr, reach={t: first_reach(r["curve"], t) for t in targets})
        results.append(r)
        cells = [f"{h[0]:>6} ({h[1]:>6.1f})" if h else f"{'>' + str(args.max_steps):>15}"
                 for h in (r["reach"][t] for t in targets)]
        print(f"{opt:<14} {strategy or '-':<8} {lr:>7g} " + " ".join(cells) + f" {r['accuracy']:>9.4f}", flush=True)

    for t in targets:
        def best(rows):
            rows = [r for r in rows if r["reach"][t]]
            return min(rows, key=lambda r: r["reach"][t][0]) if rows else None

        first = best([r for r in results if r["optimizer"] != "kfac"])
        for opt in ("sgd-momentum", "adam"):  # a sweep must bracket its best learning rate
            rows = [r for r in results if r["optimizer"] == opt]
            b = best(rows)
            lrs = sorted(r["lr"] for r in rows)
            if b is not None and len(lrs) > 1 and b["lr"] in (lrs[0], lrs[-1]):
                print(f"@{t} {opt}: the best lr {b['lr']:g} is at the edge of the sweep {lrs}: extend it")
        for strategy in ("chief", "split"):
            k = best([r for r in results if r["strategy"] == strategy])
            if k is None:
                print(f"@{t} kfac {strategy}: did not reach {t} in {args.max_steps} steps: MISS")
                continue
            ks, kt = k["reach"][t]
            if first is None:  # no first-order run got there: it needs more than the budget
                ratio = ks / args.max_steps
                print(f"@{t} kfac {strategy}: {ks} steps ({kt:.1f} s); no first-order run reached {t} in "
                      f"{args.max_steps} steps: < {ratio:.2f}x (target <= {STEPS_TARGET}x: "
                      f"{'PASS' if ratio <= STEPS_TARGET else 'MISS'})")
                continue
            fs, ft = first["reach"][t]
            ratio = ks / fs
            print(f"@{t} kfac {strategy}: {ks} steps ({kt:.1f} s) / best first-order ({first['optimizer']} lr "
                  f"{first['lr']:g}) {fs} steps ({ft:.1f} s) = {ratio:.2f}x (target <= {STEPS_TARGET}x: "
                  f"{'PASS' if ratio <= STEPS_TARGET else 'MISS'})")


def time_per_step(args):
    sizes = [int(n) for n in args.scaling_np.split(",") if n]
    if not sizes:
        return
    print(f"\nK-FAC time per step (ms), {args.scaling_steps} steps, global batch {args.batch_size}, "
          f"inverses every {args.scaling_inv_every} step(s), factors every 5")
    print(f"{'ranks':>5} {'strategy':<8} {'gradient':>9} {'factor':>8} {'inv max':>8} {'inv mean':>9} "
          f"{'cpu max':>8} {'cpu mean':>9} {'comm':>8} {'step':>8}")
    inverse = {}
    for n in sizes:
        if args.batch_size % n:
            print(f"{n:>5} skipped: {args.batch_size} is not divisible by {n}")
            continue
        for strategy in ("chief", "split"):
            r = run_example(n, args, ["--optimizer", "kfac", "--strategy", strategy, "--steps",
                                      str(args.scaling_steps), "--eval-every", "0",
                                      "--inv-update-every", str(args.scaling_inv_every)])
            t = r["timings"]
            inv = [t[k]["inverse"] * 1e3 for k in sorted(t)]
            cpu = [t[k]["inverse_cpu"] * 1e3 for k in sorted(t)]
            t0 = t[0]
            inverse[(n, strategy)] = max(inv), max(cpu)
            print(f"{n:>5} {strategy:<8} {t0['gradient'] * 1e3:>9.1f} {t0['factor'] * 1e3:>8.1f} {max(inv):>8.2f} "
                  f"{sum(inv) / len(inv):>9.2f} {max(cpu):>8.2f} {sum(cpu) / len(cpu):>9.2f} "
                  f"{t0['communication'] * 1e3:>8.1f} {sum(t0[k] for k in TIMINGS) * 1e3:>8.1f}", flush=True)
    cores = os.cpu_count()
    for n in sizes:
        if n > 1 and (n, "chief") in inverse:
            (c, cc), (s, sc) = inverse[(n, "chief")], inverse[(n, "split")]
            print(f"{n} ranks: split's busiest rank inverts in {s:.2f} ms/step ({sc:.2f} ms CPU) vs chief's "
                  f"{c:.2f} ms/step ({cc:.2f} ms CPU): {s / c:.2f}x wall, {sc / cc:.2f}x CPU: "
                  f"{'PASS' if s < c else 'MISS'}" + (f" (more ranks than the {cores} cores: split's ranks invert "
                                                       f"at once and share them)" if n > cores else ""))


def main(argv=None):
    args = parse_args(argv)
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    steps_to_target(args)
    time_per_step(args)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
