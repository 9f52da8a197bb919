"""Every collective x dtype x op against a numpy reference on random data, over real processes."""
import random

import pytest

from harness import check_ok, run_workers

FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "int16", "int32", "int64", "uint8"]
ENGINE = {"SDP_FAST_LANE": "0"}  # the engine path itself (small allreduces take the lane otherwise)


def make_cases(seed=1234):
    rng = random.Random(seed)
    cases, s = [], 0
    for dtype in FLOATS + INTS + ["bool"]:
        ops = ["SUM", "MIN", "MAX"] + ([] if dtype == "bool" else ["AVERAGE", "PRODUCT"])
        for op in ops:
            s += 1
            shape = rng.choice([[rng.randint(0, 5)], [rng.randint(1, 40), rng.randint(1, 4)], [rng.randint(20000, 40000)]])
            if op == "PRODUCT" or dtype in ("int8", "uint8", "float16", "bfloat16"):
                shape = shape[:1] if shape[0] < 100 else [rng.randint(1, 50)]
            cases.append(["allreduce", dtype, op, shape, s])
        for kind in ["allgather", "broadcast", "alltoall"]:
            s += 1
            cases.append([kind, dtype, None, [rng.randint(6, 60), rng.randint(1, 3)], s])
        for op in ops:
            s += 1
            cases.append(["reducescatter", dtype, op, [rng.randint(1, 30), 2], s])
        s += 1
        cases.append(["grouped_allgather", dtype, None, [rng.randint(1, 5), 2], s])
        if dtype != "bool":
            s += 1
            cases.append(["allreduce_scaled", dtype, "SUM", [rng.randint(1, 40)], s])
    return cases


@pytest.mark.parametrize("n, slab", [(1, None), (2, None), (3, None), (4, None), (2, "0"), (3, "0"), (3, "engine")])
def test_every_collective_dtype_and_op(n, slab):
    """Shared memory where the ranks share a host (small allreduces in the fast lane, or with
    the lane off in the engine's shared-memory collectives), and (slab 0) ZeroMQ only, as
    between hosts."""
    cases = make_cases()
    env = None if slab is None else ENGINE if slab == "engine" else {"SDP_SHM_SLAB_BYTES": slab}
    values = check_ok(run_workers(n, "workers_collectives:every_collective", [cases], timeout=180, env=env))
    for rank, oks in enumerate(values):
        bad = [c for c, ok in zip(cases, oks) if not ok]
        assert not bad, f"rank {rank} wrong for {bad}"


def test_objects_barrier_grouped():
    values = check_ok(run_workers(3, "workers_collectives:objects_and_barrier", []))
    for got, every, grouped in values:
        assert got == {"from": 1, "list": [1, 1, 1]}
        assert every == [["rank", 0], ["rank", 1], ["rank", 2]]
        assert grouped == [[3.0] * 3, [3] * 2]


def test_repeated_allgather_with_changing_rows_is_not_cached_wrongly():
    assert all(check_ok(run_workers(3, "workers_collectives:repeated_uneven_allgather", [5])))


def test_allreduce_into_preallocated_and_in_place():
    for same, inplace, bad in check_ok(run_workers(2, "workers_collectives:out_and_in_place", [])):
        assert same and inplace == 3.0
        assert "out= for 'bad' must be" in bad


def test_back_to_back_shared_memory_allreduces_stay_exact():
    assert all(check_ok(run_workers(3, "workers_collectives:back_to_back_shm", [60])))


@pytest.mark.parametrize("n, slab", [(2, None), (3, None), (2, "0"), (3, "0")])
def test_float16_average_accumulates_in_float32(n, slab):
    """Shared memory, and (slab 0) the ZeroMQ ring and recursive doubling, where the last step
    sums in float32 and scales before rounding (with 3 ranks the contributions are scaled
    first, so partial sums of large values cannot overflow either)."""
    env = None if slab is None else {"SDP_SHM_SLAB_BYTES": slab}
    for lo, hi, finite, small in check_ok(run_workers(n, "workers_collectives:fp16_average_no_overflow", [],
                                                      env=env)):
        assert finite and lo == hi and abs(lo - (40000 + (n - 1) / 2)) <= 32  # float16 spacing at 40000: 32
        assert abs(small - 3e-5 * n) < 1e-6


@pytest.mark.parametrize("n, slab", [(2, None), (3, None), (3, "0"), (2, "65536")])
def test_fused_buckets(n, slab):
    """Packed as the shared-memory collective goes; or (slab 0: the ZeroMQ ring; a slab smaller
    than the bucket: several shared-memory slabs) packed into the result and reduced in place."""
    env = None if slab is None else {"SDP_SHM_SLAB_BYTES": slab}
    for oks in check_ok(run_workers(n, "workers_collectives:fused_buckets", [5], env=env)):
        assert all(oks), oks


@pytest.mark.parametrize("n", [2, 3])
def test_steady_state_lists_through_the_batch_cache(n):
    for ok, batches, most in check_ok(run_workers(n, "workers_collectives:steady_state_lists", [12], env=ENGINE)):
        assert ok and batches >= 1 and most == 5, (ok, batches, most)  # (the whole list: one batch)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_kind_through_the_shared_memory_control_path(n):
    """One host: negotiation requests and responses travel in shared-memory rings with a pipe
    doorbell (sdp.transport.shm_ctrl), a request too large for a ring over ZeroMQ in order."""
    for rings, sent, ok in check_ok(run_workers(n, "workers_collectives:control_path", [6])):
        assert rings and sent > 0 and ok, (rings, sent, ok)


@pytest.mark.parametrize("capacity, longest", [("0", 0), ("2", 2), ("5", 5)])
def test_response_cache_capacity(capacity, longest):
    """HOROVOD_CACHE_CAPACITY: 0 (no cache: every request in full, no batch cache), fewer
    entries than the list's 5 tensors (the rest negotiated in full every step: a batch holds
    at most the 2 cached ones, when an engine happened to send just those), exactly 5 (the
    whole list becomes a batch)."""
    env = {"HOROVOD_CACHE_CAPACITY": capacity, **ENGINE}
    for ok, known, most in check_ok(run_workers(2, "workers_collectives:steady_state_lists", [9], env=env)):
        assert ok and most <= longest, (ok, known, most)
        assert most == 5 if capacity == "5" else (known == 0 if capacity == "0" else True), (known, most)


@pytest.mark.parametrize("pool", ["134217728", "2097152", "0"])
def test_results_held_by_one_rank_stay_exact(pool):
    """Default pool (never full here), a 2 MB pool that rank 0 exhausts after a few steps (the
    ranks then fall back to copying out), and no pool at all.  (The engine's collectives: the
    fast lane's results come from the heap, as only their own rank writes them.)"""
    values = check_ok(run_workers(3, "workers_collectives:held_results", [12],
                                  env={"SDP_SHM_POOL_BYTES": pool, "SDP_FAST_LANE": "0"}))
    for rank, (ok, free) in enumerate(values):
        assert ok, (rank, pool)
        if pool == "0":
            assert free is None
    if pool == "2097152":
        assert values[0][1] < 4096 * 64, "rank 0 should have used up its pool"


@pytest.mark.parametrize("n", [2, 3])
def test_grouped_allreduce_of_small_arrays_is_one_request_per_dtype(n):
    for checks in check_ok(run_workers(n, "workers_collectives:flattened_groups", [], env=ENGINE)):
        assert all(ok for _, ok in checks), checks
