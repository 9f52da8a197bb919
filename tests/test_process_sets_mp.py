"""Process sets (Horovod's ``process_set=``): sets of 2 and 3 ranks in a 4-rank job, real
processes over real sockets (tests/harness.py), each result against numpy; workers in
tests/workers_process_sets.py.  Set A = ranks [0, 1], set B = ranks [1, 2, 3]: rank 1 is in both,
and every rank has collectives of both sets and of the global set in flight at once."""

from harness import check_ok, run_workers
from sdp.engine.coordinator import Coordinator
from workers_process_sets import A_RANKS, B_RANKS


def test_overlapping_sets_match_numpy():
    values = check_ok(run_workers(4, "workers_process_sets:numpy_sets", timeout=120))
    for rank, res in enumerate(values):
        assert res.pop("ids") == [1, 2]
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, f"rank {rank}: {bad}"
        expected = {"ar_global"} | {f"{k}{ps}" for ps, members in ((1, A_RANKS), (2, B_RANKS)) if rank in members
                                    for k in ("ar_sum", "ar_avg_big", "ar_int_avg", "ag", "bc", "rs", "a2a",
                                              "a2a_splits", "bobj", "gobj")}
        assert expected <= set(res), f"rank {rank} ran {sorted(res)}"


def test_error_cases_name_the_set_and_rank():
    values = check_ok(run_workers(4, "workers_process_sets:numpy_errors", timeout=60))
    for rank, out in enumerate(values):
        assert out["unknown"].startswith("ValueError") and "process set 77 is not registered" in out["unknown"]
        assert "duplicate" in out["duplicate"] and "[0, 1]" in out["duplicate"]
        assert "ValueError" in out["bad_ranks"] and "[0, 9]" in out["bad_ranks"]
        assert "[0, 1, 2, 3] is a duplicate (of process set 0)" in out["global_dup"]
        assert "rank 2 has [[0, 2]]" in out["differ"] and "rank 0 has [[0, 3]]" in out["differ"]
        assert out["removed"] is True and out["removed_again"] is False
        assert out["global"] == [4.0]
        if rank not in A_RANKS:
            assert out["outsider"] == (f"ValueError: allreduce of 'x': rank {rank} is not in process set 1 "
                                       "(ranks [0, 1]); only the set's ranks may call its collectives")
        else:
            assert "TensorMismatchError" in out["root"] and "root rank 3 is not in the process set" in out["root"]
            assert "process set 1, ranks [0, 1]" in out["root"]
            assert "process set 1 is not registered" in out["use_removed"]
        if rank in B_RANKS:
            assert "shape mismatch" in out["shape"] and "(process set 2, ranks [1, 2, 3])" in out["shape"]
            assert out["after"] == [3.0, 3.0]


def test_disjoint_sets_do_not_wait_for_each_other():
    """Set [2, 3] completes 20 allreduces while set [0, 1] still waits for its late rank 1
    (negotiated by rank 0, which is in the other set)."""
    values = check_ok(run_workers(4, "workers_process_sets:disjoint_sets", timeout=60))
    fast = max(v[0] for v in values[2:])
    slow = min(v[1] for v in values[:2])
    assert slow >= 2.0 and fast < 1.5, values


def test_coordinator_refuses_a_rank_outside_the_set():
    """A peer that skips the local check (or lies) is refused by rank 0's coordinator: an error item
    naming the set and the rank, and the set's collective still runs for its members."""
    c = Coordinator(4)
    c.sets[1] = [0, 1]
    meta = {"n": "x@ps1", "k": "allreduce", "d": "<f4", "s": [2], "o": 1, "r": None, "pre": 1.0,
            "post": 1.0, "sp": None, "ps": 1}
    errs = c.add(3, {"new": [dict(meta)], "ids": []})
    assert errs and errs[0]["n"] == "x@ps1" and "rank 3" in errs[0]["err"] and "process set 1" in errs[0]["err"]
    assert c.add(0, {"new": [dict(meta)], "ids": []}) == []
    assert c.ready() == []  # waits for rank 1 only, not for ranks 2 and 3
    c.add(1, {"new": [dict(meta)], "ids": []})
    items = c.ready()
    assert [(i["n"], i["ps"]) for i in items] == [("x@ps1", 1)]
    # the cached id is never taken by the batch cache (which waits for every rank of the job)
    assert c.add(0, {"ids": [items[0]["id"]]}) == [] and c.add(1, {"ids": [items[0]["id"]]}) == []
    assert [i["n"] for i in c.ready()] == ["x@ps1"]


def test_horovod_tensorflow_face():
    """Under Horovod's names: static sets from hvd.init(process_sets=...), a dynamic one from
    hvd.add_process_set (ValueError until HOROVOD_DYNAMIC_PROCESS_SETS=1); collectives, graph ops,
    DistributedGradientTape, DistributedOptimizer and broadcast_variables on each set."""
    values = check_ok(run_workers(4, "workers_process_sets:hvd_face", timeout=120, init=False))
    for rank, out in enumerate(values):
        assert out.pop("no_dynamic") == ("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets "
                                         "after Horovod initialization.")
        assert out.pop("c") == [3, [0, 2]]
        if rank in (0, 2):
            assert out.pop("c_sum") == [4.0]
        assert out.pop("removed") == [True, None, False]
        assert out.pop("ids") == [1, 2]
        assert out.pop("b_ranks") == [1, 2, 3]
        assert out.pop("included") == [rank in A_RANKS, rank in B_RANKS, True]
        assert out.pop("sizes") == [2, 3, 4]
        assert out.pop("set_rank") == [A_RANKS.index(rank) if rank in A_RANKS else None,
                                       B_RANKS.index(rank) if rank in B_RANKS else None]
        assert out.pop("ops") == [int(rank in A_RANKS), 3, 4]
        for ps, members in ((1, A_RANKS), (2, B_RANKS)):
            if rank not in members:
                assert out.pop(f"outsider{ps}") == (f"rank {rank} is not in process set {ps} (ranks {members}); "
                                                    "only the set's ranks may call its collectives")
        bad = {k: v for k, v in out.items() if v is not True}
        assert not bad, f"rank {rank}: {bad}"
        n_checks = sum(rank in m for m in (A_RANKS, B_RANKS)) * 9
        assert len(out) == n_checks, f"rank {rank}: {sorted(out)}"


def test_a_rank_outside_a_set_may_leave_while_the_set_runs():
    """A rank that is in no pending collective's set shuts down (its peers see it leave) while
    the set's members still run theirs: they complete (a lost rank fails only collectives that
    need it: global ones, or its sets'; it failed every pending one)."""
    values = check_ok(run_workers(3, "workers_process_sets:outsider_leaves_first", timeout=60))
    assert values[1] is None
    for r in (0, 2):
        assert values[r] == [[2.0] * 4, {"from": 2}], (r, values[r])


def test_process_set_ids_restart_after_reinit():
    values = check_ok(run_workers(3, "workers_process_sets:ids_after_reinit", []))
    for rank, (before, after, got) in enumerate(values):
        assert before == after == 1 and got == ([2.0, 2.0] if rank < 2 else None), (rank, before, after, got)
