"""Bad input and failures are errors on every rank within a bounded time, never hangs."""
import glob
import os
import re

import pytest

from harness import check_ok, run_workers


MISMATCHES = [
    ("shape", "allreduce of 'grad_3': shape mismatch, rank 0 has [2, 3], rank 1 has [3, 3]"),
    ("dtype", "allreduce of 'grad_3': dtype mismatch, rank 0 has float32, rank 1 has float64"),
    ("op", "allreduce of 'grad_3': reduce op mismatch, rank 0 has SUM, rank 1 has MAX"),
    ("collective", "collective of 'grad_3': op mismatch, rank 0 has allreduce, rank 1 has broadcast"),
    ("root", "broadcast of 'grad_3': root rank mismatch, rank 0 has 0, rank 1 has 1"),
    ("bad_root", "broadcast of 'grad_3': root rank 5 is not a valid rank (world size 2)"),
    ("prescale", "allreduce of 'grad_3': prescale factor mismatch, rank 0 has 1.0, rank 1 has 2.0"),
    ("allgather", "allgather of 'grad_3': shape (all but the first dimension) mismatch, rank 0 has [3], "
                  "rank 1 has [4]"),
    ("postscale", "allreduce of 'grad_3': postscale factor mismatch, rank 0 has 1.0, rank 1 has 0.5"),
    ("allgather_dtype", "allgather of 'grad_3': dtype mismatch, rank 0 has int64, rank 1 has int32"),
    ("broadcast_shape", "broadcast of 'grad_3': shape mismatch, rank 0 has [4], rank 1 has [5]"),
    ("reducescatter_shape", "reducescatter of 'grad_3': shape mismatch, rank 0 has [4, 2], rank 1 has [4, 3]"),
    ("alltoall_splits", "alltoall of 'grad_3': rank 1 has splits [1, 2] for first dimension 4; splits must be "
                        "2 non-negative ints summing to the first dimension"),
    ("alltoall_negative", "alltoall of 'grad_3': rank 1 has splits [-1, 5] for first dimension 4; splits must "
                          "be 2 non-negative ints summing to the first dimension"),
]


@pytest.mark.parametrize("kind,expect", MISMATCHES)
def test_mismatch_raises_on_every_rank(kind, expect):
    _mismatch_raises(kind, expect)


@pytest.mark.parametrize("kind, expect", [MISMATCHES[0], MISMATCHES[2]])
def test_mismatch_raises_on_every_rank_without_the_response_cache(kind, expect):
    _mismatch_raises(kind, expect, {"HOROVOD_CACHE_CAPACITY": "0"})


def _mismatch_raises(kind, expect, env=None):
    values = check_ok(run_workers(2, "workers_errors:mismatch", [kind], timeout=60, env=env))
    for rank, (etype, msg, seconds, still_works) in enumerate(values):
        assert etype == "TensorMismatchError", (rank, etype, msg)
        assert msg == expect, (rank, msg)
        assert seconds < 5, (rank, seconds)
        assert still_works, rank


@pytest.mark.parametrize("victim, fused, tcp", [(1, False, False), (1, True, False), (0, False, False),
                                               (0, True, False), (2, True, False), (1, True, True), (0, False, True)])
def test_killed_worker_makes_others_raise_peer_lost(victim, fused, tcp):
    """Any rank, the coordinator (rank 0) included, killed between or inside collectives; on one
    host (shared memory, ipc://) or (tcp: a host name per rank) over TCP, as between hosts."""
    hosts = (lambda r: {"SDP_HOSTNAME": f"host{r}"}) if tcp else None
    results = run_workers(3, "workers_errors:die_or_wait", [victim, fused], timeout=60, per_rank_env=hosts)
    assert results[victim].returncode == -9
    for r in {0, 1, 2} - {victim}:
        assert results[r].ok, results[r].stderr[-2000:]
        etype, msg, lost, seconds, wire = results[r].value
        assert wire == tcp  # no shared memory between "hosts"
        assert etype == "PeerLostError" and lost == victim, (r, etype, msg)
        assert f"rank {victim}" in msg
        assert seconds < 10, seconds


@pytest.mark.parametrize("victim", [0, 2])
def test_a_rank_killed_while_the_others_wait_on_the_doorbell_is_reported_within_1s(victim, tmp_path):
    """One host, control messages in shared memory: the survivors' engine threads sleep on their
    doorbells (waiting for the victim's request, or for rank 0's answer) when the victim is
    killed; each raises PeerLostError naming it within 1 s of the kill."""
    stamp, job = str(tmp_path / "killed_at"), os.urandom(6).hex()
    results = run_workers(3, "workers_errors:killed_in_doorbell", [victim, stamp], timeout=60,
                          env={"SDP_JOB_ID": job})
    assert results[victim].returncode == -9
    with open(stamp) as f:
        killed_at = float(f.read())
    for r in {0, 1, 2} - {victim}:
        assert results[r].ok, results[r].stderr[-2000:]
        etype, lost, raised_at, rings = results[r].value
        assert rings, r
        assert etype == "PeerLostError" and lost == victim, (r, etype, lost)
        assert raised_at - killed_at < 1.0, (r, raised_at - killed_at)
    assert not glob.glob(f"/dev/shm/sdp-{job}*")  # rings live in the memfd segments: nothing named


def test_a_peer_killed_while_a_sent_buffer_is_queued_to_it_is_reported():
    """Over TCP, rank 0 broadcasts 64 MB to rank 1, which is stopped and then killed: ZeroMQ never
    releases rank 0's queued buffer, and rank 0 must still raise PeerLostError within seconds
    (it once waited on the buffer for the whole SDP_TIMEOUT, 300 s)."""
    hosts = lambda r: {"SDP_HOSTNAME": f"host{r}"}  # noqa: E731
    results = run_workers(2, "workers_errors:killed_while_receiving", [64 << 20], timeout=60, per_rank_env=hosts)
    assert results[1].returncode == -9
    assert results[0].ok, results[0].stderr[-2000:]
    etype, msg, lost, seconds = results[0].value
    assert (etype, lost) == ("PeerLostError", 1), (etype, msg)
    assert seconds < 10, seconds


def test_stall_warning_names_missing_rank_and_shutdown_time_aborts():
    results = run_workers(2, "workers_errors:stall", [None], timeout=60,
                          env={"SDP_STALL_CHECK_TIME": "1", "SDP_STALL_SHUTDOWN_TIME": "3", "STALL_SLEEP": "5"})
    values = check_ok(results)
    assert "stall" in results[0].stderr and "'lonely'" in results[0].stderr
    assert "missing ranks [1]" in results[0].stderr
    for etype, msg, seconds in values:
        assert etype == "StallError", (etype, msg)
        assert "lonely" in msg and "SDP_STALL_SHUTDOWN_TIME" in msg


@pytest.mark.parametrize("n", [2, 3])
def test_random_submission_order(n):
    assert all(check_ok(run_workers(n, "workers_errors:random_order", [40, 7])))


def test_foreign_messages_are_dropped_and_logged():
    results = run_workers(2, "workers_errors:foreign_message", [None])
    assert check_ok(results) == [2.0, 2.0]
    # (the unauthenticated connection never gets as far as a message: refused, with its source, or,
    # when ZeroMQ closed it before the guard read its address, as from an unknown address; the
    # source itself is checked in test_hostile.py)
    assert re.search(r"refused a connection from (127\.0\.0\.1|an unknown address \(closed before its address "
                     r"was read\))", results[0].stderr), results[0].stderr[-2000:]


def test_malformed_control_messages_are_dropped_and_logged():
    results = run_workers(2, "workers_errors:malformed_control", [], env={"SDP_FAST_LANE": "0"})  # (engine path)
    assert check_ok(results) == [[2.0, 4.0, 6.0]] * 2
    err = results[0].stderr
    for why in ("bad or missing 'k'", "unknown dtype 'float99'", "bad or missing 'o': 99"):
        assert f"malformed tensor request ({why}" in err, err[-3000:]
    assert err.count("unknown cache id") == 2 and err.count("dropping malformed request") == 2
    assert "dropping malformed control message" in err  # a list, not an object
    assert results[1].stderr.count("dropping malformed response") == 5, results[1].stderr[-3000:]


def test_calls_before_init_and_init_twice():
    values = check_ok(run_workers(1, "workers_errors:before_init_and_twice", [None], init=False))[0]
    assert values[0][0] == "NotInitializedError" and "sdp.init()" in values[0][1]
    assert values[1][0] == "NotInitializedError"
    assert values[2][0] == "NotInitializedError" and "before alltoall()" in values[2][1]
    assert values[3][0] == "NotInitializedError" and "before broadcast_object()" in values[3][1]
    assert values[4][0] == "none"  # a second sdp.init() is a no-op (Horovod's rule; SMDDP's names raise)
    assert values[5] == [True, True, True, 1.0]


def test_unsupported_dtypes_are_refused_and_the_engine_goes_on():
    for errs, moved, after in check_ok(run_workers(2, "workers_errors:unsupported_dtypes", [])):
        assert errs == ["allreduce of 'obj': dtype object", "broadcast of 'objb': dtype object",
                        "allreduce of 'str': dtype <U1", "reducescatter of 'cplx': dtype complex64"], errs
        assert moved == ["ab", "c", "ab", "c"] and after == 2.0


def test_bool_average_or_scaling_is_refused_and_the_engine_goes_on():
    for errs, any_, all_ in check_ok(run_workers(2, "workers_errors:bool_average", [])):
        assert [e.split(":")[0] for e in errs] == ["allreduce of 'avg'", "allreduce of 'pre'", "reducescatter of 'rs'"]
        assert all("bool tensors take SUM/MAX (logical or) or MIN/PRODUCT (logical and)" in e for e in errs), errs
        assert "got AVERAGE" in errs[0] and "prescale 2" in errs[1]
        assert any_ == [True, False, True] and all_ == [True, False, False]


def test_join_fills_zeros_for_ranks_out_of_data():
    values = check_ok(run_workers(3, "workers_errors:uneven_then_join", [[4, 2, 3]]))
    assert values[0][0] == [3.0, 3.0, 2.0, 1.0]  # ranks 1 then 2 joined and contributed zeros
    assert values[1][0] == [3.0, 3.0] and values[2][0] == [3.0, 3.0, 2.0]
    assert all(v[1] == 0 for v in values)  # rank 0 joined last
    assert all(v[2] == 3.0 for v in values)  # normal service afterwards


def test_allreduce_from_several_threads_in_different_orders():
    assert all(check_ok(run_workers(3, "workers_errors:threads_submit", [4, 15])))


def test_shutdown_of_the_last_ranks_is_not_held_by_undeliverable_byes():
    # a BYE queued to a peer that had already closed held the closing rank for the whole 2 s
    # ZeroMQ linger (in 4 runs of 6 with 4 ranks); now every rank leaves within ~0.2 s (1.13 s
    # once at load 8 on 2 cores: the bound stays well below the 2 s the defect costs)
    for _ in range(3):
        seconds = check_ok(run_workers(4, "workers_errors:timed_shutdown", [None], timeout=60))
        assert max(seconds) < 1.5, seconds
