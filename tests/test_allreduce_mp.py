"""Allreduce and broadcast across real processes over real sockets, against a numpy reference."""
import pytest

from harness import check_ok, run_workers

SIZES = [[], [0], [1], [7], [1000], [3, 5, 7], [100_003], [600_001]]  # scalar, empty, odd, not divisible, > ring threshold


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allreduce_matches_numpy(n):
    cases, seed = [], 0
    for shape in SIZES:
        for dtype, op in [("float32", "SUM"), ("float64", "AVERAGE"), ("float16", "SUM"), ("int32", "MIN"),
                          ("int64", "MAX"), ("uint8", "MAX"), ("float32", "AVERAGE")]:
            if shape == [600_001] and dtype not in ("float32",):
                continue
            seed += 1
            cases.append([shape, dtype, op, seed])
    values = check_ok(run_workers(n, "workers_collectives:allreduce_cases", [cases], timeout=120))
    for rank, oks in enumerate(values):
        bad = [c for c, ok in zip(cases, oks) if not ok]
        assert not bad, f"rank {rank} wrong for {bad}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_broadcast_from_every_root(n):
    cases = [[shape, dtype, root, i * 10 + root] for i, (shape, dtype) in enumerate(
        [([5], "float32"), ([0], "int64"), ([300_007], "float64"), ([4, 4], "uint8")]) for root in range(n)]
    values = check_ok(run_workers(n, "workers_collectives:broadcast_cases", [cases]))
    for rank, oks in enumerate(values):
        assert all(oks), f"rank {rank}: {[c for c, ok in zip(cases, oks) if not ok]}"


def test_ranks_get_identical_bits():
    values = check_ok(run_workers(3, "workers_collectives:checksum_of_allreduce", [1_000_003]))
    assert len(set(values)) == 1


@pytest.mark.parametrize("slab", ["0", "65536"])
def test_allreduce_ring_and_multi_slab_paths(slab):
    """SDP_SHM_SLAB_BYTES=0 forces the ZeroMQ ring; a small slab forces many shared-memory slabs."""
    cases = [[[300_007], "float32", "SUM", 1], [[200_003], "float64", "AVERAGE", 2],
             [[100_001], "float16", "SUM", 3], [[100_000], "int32", "MAX", 4]]
    values = check_ok(run_workers(3, "workers_collectives:allreduce_cases", [cases],
                                  env={"SDP_SHM_SLAB_BYTES": slab}))
    for rank, oks in enumerate(values):
        assert all(oks), (rank, slab, oks)
