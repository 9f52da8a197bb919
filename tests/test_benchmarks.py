"""The allreduce benchmark runs end to end under sdprun (2 real processes) and prints every table.

Speed is not checked here (benchmarks check speed); this keeps the script from rotting."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(*args, script="benchmarks/allreduce.py") -> str:
    """stdout of ``sdprun -np 2 python <script> *args`` (which must succeed)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, script, *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_allreduce_benchmark_prints_both_tables_and_the_memory_floor():
    out = run_benchmark("--sizes", "1K,64K", "--baseline", "none", "--fused-iters", "5", "--latency-iters", "200",
                        "--isolated-iters", "20", "--target-s", "0.05")
    rows = re.findall(r"\[0\]<stdout>:\s+(1024|65536)\s+\d+\s+\d+\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+) \|", out)
    assert [r[0] for r in rows] == ["1024", "65536"], out[-3000:]
    for _, t, alg, bus in rows:  # busbw = algbw * 2(n-1)/n = algbw for 2 ranks
        assert float(t) > 0 and abs(float(alg) - float(bus)) <= 0.0015, rows
    for label in ("fused: 100 x allreduce_async", "unfused: allreduce_async, fusion threshold 0",
                  "unfused+unpipelined", "1 KB latency", "1 KB median <= 1000 us",
                  "latency floor: pipe ping-pong round trip", "1 KB isolated <= 2.0 RTT"):
        assert label in out, (label, out[-3000:])
    colls = dict(re.findall(r"<stdout>:(fused: \S+ .*?|unfused: .*?)\s+\d+\s+[0-9.]+\s+(\d+)\s+[0-9.]+\s+[0-9.]+x", out))
    # one batch is one bucket; 100 async calls may be picked up by the engine in two cycles
    assert colls["fused: grouped_allreduce_async (1 batch)"] == "1", colls
    assert int(colls["fused: 100 x allreduce_async, wait all"]) <= 3, colls
    assert colls["unfused: allreduce_async, fusion threshold 0"] == "100", colls
    floor = re.search(r"memory floor \(shared memory, 2 ranks\): ([0-9.]+) ms = 1.50 x ([0-9.]+) ms", out)
    assert floor and abs(float(floor.group(1)) - 1.5 * float(floor.group(2))) <= 0.0126, out[-2000:]  # both printed to 0.01 ms


def test_api_comparison_prints_every_api_its_floor_and_the_targets():
    out = run_benchmark("--api", "numpy,tf-eager,tf-function", "--sizes", "1K,1M", "--baseline", "none",
                        "--iters", "20", "--warmup", "3")
    assert re.search(r"numpy us\s+busbw\s+tf-eager us\s+busbw\s+tf-function us\s+busbw\s+floor us", out), out[-3000:]
    rows = re.findall(r"<stdout>:\s+(1K|1M)((?:\s+[0-9.]+\s+[0-9.]+){4})\s+([0-9.]+)x\s+([0-9.]+)x", out)
    assert [r[0] for r in rows] == ["1K", "1M"], out[-3000:]
    for size, cols, eager_ratio, fn_ratio in rows:
        t = [float(v) for v in cols.split()[::2]]  # numpy, tf-eager, tf-function, floor (us)
        assert all(v > 0 for v in t), rows
        assert abs(float(fn_ratio) - t[0] / t[2]) <= 0.01 + 0.01 * t[0] / t[2], rows
    for label in ("tf-eager 1 KB <= 500 us", "tf-function 1 KB <= 500 us", "tf-function busbw @1M >= 0.9x numpy",
                  "an empty tf.function call", "column 'floor'"):
        assert label in out, (label, out[-3000:])


def test_latency_section_measures_its_floor_and_states_targets_as_round_trips():
    out = run_benchmark("--latency-only", "--breakdown", "--latency-iters", "50", "--isolated-iters", "20")
    rtt = re.search(r"latency floor: pipe ping-pong round trip between two processes \(RTT\)\s+([0-9.]+) us", out)
    assert rtt and float(rtt.group(1)) > 0, out[-3000:]
    rounds = re.search(r"\(RTT\)\s+([0-9.]+) us \(the median of 5 rounds', each taken before its round: "
                       r"([0-9.]+)-([0-9.]+) us", out)  # (the floor beside each round's latencies)
    assert rounds and float(rounds.group(2)) <= float(rounds.group(1)) <= float(rounds.group(3)), out[-3000:]
    rows = dict(re.findall(r"<stdout>:(1 KB back to back|1 KB isolated \(barrier, 1 ms idle\)|64 KB back to back|"
                           r"64 KB isolated|step of 100 x 4 KB: grouped_allreduce)\s+([0-9.]+) us\s+[0-9.]+ RTT", out))
    assert len(rows) == 5 and all(float(v) > 0 for v in rows.values()), out[-3000:]
    for label in ("1 KB back to back <= 1.5 RTT", "1 KB isolated <= 2.0 RTT", "64 KB back to back <= 2.0 RTT",
                  "step grouped <= 5 RTT + memory", "step one by one <= 3x (grouped bound)"):
        assert re.search(re.escape(label) + r": [0-9.]+ us <= [0-9.]+ us  (PASS|FAIL)", out), (label, out[-3000:])
    # the data floor (shm_floor.c, compiled by the run, measured beside each round), beside the targets it bounds
    floor = re.search(r"data floor \(copy into shared memory \+ reduce, .*the median of 5 rounds', each beside its "
                      r"round\): 64 KB\s+([0-9.]+) us\s+[0-9.]+ RTT, the step's 400 KB in one buffer\s+([0-9.]+) us\s+"
                      r"[0-9.]+ RTT \(([0-9.]+)-([0-9.]+) us\)", out)
    assert floor and 0 < float(floor.group(1)) < float(floor.group(2)), out[-3000:]
    assert float(floor.group(3)) <= float(floor.group(2)) <= float(floor.group(4)), out[-3000:]
    assert len(re.findall(r"(64 KB back to back|step grouped|step one by one) .*(PASS|FAIL) \(data floor [0-9.]+ us",
                          out)) == 3, out[-3000:]
    # the phase breakdown, back to back and isolated, one line per rank each
    assert len(re.findall(r"rank [01]: submit->engine awake [0-9.]+, awake->request sent", out)) == 4, out[-3000:]


def test_the_data_floor_program_sums_and_refuses_bad_arguments(tmp_path):
    exe = tmp_path / "shm_floor"
    subprocess.run(["cc", "-O3", "-march=native", "-o", str(exe), os.path.join(ROOT, "benchmarks", "shm_floor.c")],
                   check=True, timeout=120)
    p = subprocess.run([str(exe), "64", "50", "65536", "20"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr  # (it checks one sum of each size: exit 4 when wrong)
    lines = [line.split() for line in p.stdout.splitlines()]
    assert [n for n, _ in lines] == ["64", "65536"] and all(0 < float(t) < 1 for _, t in lines), p.stdout
    for bad in (["100", "50"], ["64", "5"], ["64"]):  # (not a multiple of 64, too few iterations, no count)
        p = subprocess.run([str(exe)] + bad, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "shm_floor" in p.stderr and not p.stdout, (bad, p.returncode, p.stderr)


def test_blas_threads_benchmark_prints_both_modes():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, "benchmarks/blas_threads.py",
                        "--rounds", "1", "--iters", "10", "--n", "64"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    assert f"BLAS after init: [('openblas', {max(1, cores // 2)})]" in p.stdout, p.stdout[-2000:]
    rows = re.findall(r"<stdout>:(share|all cores)\s+([0-9.]+)\s+([0-9.]+)", p.stdout)
    assert [r[0] for r in rows] == ["share", "all cores"] and all(float(v) > 0 for r in rows for v in r[1:]), rows


def test_adasum_benchmark_prints_both_ops_and_their_ratio():
    out = run_benchmark("--sizes", "64K,1M", "--rounds", "1", "--target-s", "0.02", script="benchmarks/adasum.py")
    rows = re.findall(r"<stdout>:\s+(64K|1M)\s+(Average|Adasum)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*([0-9.]+x)?", out)
    assert [r[:2] for r in rows] == [("64K", "Average"), ("64K", "Adasum"), ("1M", "Average"), ("1M", "Adasum")], rows
    for _, op, t, alg, bus, ratio in rows:  # (2 ranks: busbw = algbw)
        assert float(t) > 0 and alg == bus and bool(ratio) == (op == "Adasum"), rows


def test_join_benchmark_prints_the_lane_on_after_each_join():
    out = run_benchmark("--joins", "2", "--iters", "50", script="benchmarks/join.py")
    assert "fast lane on" in out, out
    rows = re.findall(r"<stdout>:\| (before join\(\)|after join\(\) \d) \| ([0-9.]+) \|", out)
    assert [r[0] for r in rows] == ["before join()", "after join() 1", "after join() 2"], out


def test_p2p_benchmark_prints_its_table():
    """benchmarks/p2p.py: sdp.send/recv ping-pong beside Gloo's (where torch is installed)."""
    import importlib.util
    out = run_benchmark("--sizes", "1K,5M", "--rounds", "1", script="benchmarks/p2p.py")
    gloo = r"\s+[0-9.]+\s+[0-9.]+" if importlib.util.find_spec("torch") else r"\s+n/a"
    for size in ("1K", "5M"):
        assert re.search(rf"\[0\]<stdout>:\s+{size}\s+[0-9.]+\s+[0-9.]+{gloo}\s*$", out, re.M), out
