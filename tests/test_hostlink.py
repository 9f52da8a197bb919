"""Synchronous small allreduces across hosts through the host leaders' link (sdp.engine.hostlink):
real ranks on fake hosts (``SDP_HOSTNAME``), shared memory within a host, ZeroMQ between."""
import pytest

from harness import check_ok, run_workers
from test_hierarchical_mp import fake_hosts
from test_lane_mp import _compiled_step

# positions each rank of workers_hostlink.cases posts, and how many of them the link runs
CASE_POSITIONS, CASE_FAST = 59, 54


@pytest.mark.parametrize("counts", [[2, 2], [1, 1, 1], [4, 1], [1, 2, 2], "abab"])
def test_results_are_numpys_and_the_same_bits_everywhere(counts):
    """Every op and eligible dtype gives numpy's result, bit-identical on every rank, through
    the link, with its compiled step (SDP_NATIVE=1, where it builds) and without it: the same
    bits both ways; what it does not run (float16, strided, prescaled, over 64 KB, a position
    whose names differ between hosts) goes to the engine on every rank and is exact too, and the
    link runs again after it and between asynchronous allreduces."""
    n, env = fake_hosts(counts)
    runs = {switch: check_ok(run_workers(n, "workers_hostlink:cases", [],
                                         per_rank_env=lambda r: {**env(r), "SDP_NATIVE": switch}, timeout=120))
            for switch in ("1", "0")}
    for switch, values in runs.items():
        for rank, (bad, digest, fast, posted, compiled) in enumerate(values):
            assert not bad, (switch, rank, bad)
            assert digest == runs["0"][0][1], f"rank {rank} with SDP_NATIVE={switch} differs from rank 0 without"
            assert (fast, posted) == (CASE_FAST, CASE_POSITIONS), (switch, rank)
            # (the compiled step: every call it takes unless a wait outlasts its spin, 2 ms locally or
            # 10 ms for the other leaders, on a busy machine)
            assert compiled == 0 if switch == "0" or not _compiled_step() else 0 < compiled <= fast, (switch, rank)


@pytest.mark.parametrize("env, on", [({}, True), ({"SDP_ENCRYPT": "1"}, False), ({"SDP_FAST_LANE": "0"}, False)])
def test_the_link_is_on_unless_encrypting_or_a_rank_sets_the_fast_lane_off(env, on):
    """On by default (then only the leaders listen, for repairs of the link); with SDP_ENCRYPT=1 on every
    rank (no TCP link: the engine's encrypted mesh), or SDP_FAST_LANE=0 on rank 2 alone, it is
    off on every rank; the results are exact either way."""
    n, env_of = fake_hosts([2, 2])
    values = check_ok(run_workers(
        n, "workers_hostlink:link_state", [], timeout=120,
        per_rank_env=lambda r: {**env_of(r), **(env if r == 2 or "SDP_ENCRYPT" in env else {})}))
    for rank, (got, link_on, fast, listening) in enumerate(values):
        assert got == 10.0 and link_on == on and fast == int(on) and listening == (on and rank in (0, 2)), (rank, values)


@pytest.mark.parametrize("learnt", [False, True])
@pytest.mark.parametrize("kind, value", [("shape", "[5]"), ("dtype", "float64"), ("op", "MAX")])
def test_mismatches_raise_on_every_rank_and_the_link_goes_on(kind, value, learnt):
    """A call that differs on rank 3 is SLOW in the link: the engine raises TensorMismatchError
    on every rank, naming the tensor, rank 3 and its value; the next call takes the link.  Also
    where the name was learnt (the other ranks in the compiled entry, which hands the position
    back to Python)."""
    n, env = fake_hosts([2, 2])
    for rank, (etype, msg, seconds, after) in enumerate(
            check_ok(run_workers(n, "workers_hostlink:mismatch", [kind, learnt], per_rank_env=env, timeout=60))):
        assert etype == "TensorMismatchError" and "'mm.x'" in msg and f"rank 3 has {value}" in msg, (rank, msg)
        assert seconds < 5 and after, rank


def test_join_turns_the_link_off_everywhere():
    n, env = fake_hosts([2, 2])
    values = check_ok(run_workers(n, "workers_hostlink:join_midway", [], per_rank_env=env, timeout=60))
    for rank, (got, last, off, fast) in enumerate(values):
        assert got[:2] == [10.0, 10.0] and got[2:] == ([6.0] * 3 if rank < 3 else []), rank
        assert last == values[0][1] and last in (0, 1, 2) and off and fast == 2, rank


@pytest.mark.parametrize("victim", [1, 2])
def test_a_rank_killed_while_the_others_wait_is_reported_within_a_second(victim):
    """Rank 1 (not a leader) or 2 (host 1's leader) dies while the others wait in the link."""
    n, env = fake_hosts([2, 2])
    results = run_workers(n, "workers_hostlink:killed_while_waiting", [victim], per_rank_env=env, timeout=60)
    for r in results:
        if r.rank == victim:
            assert r.returncode == -9
            continue
        assert r.ok, (r.rank, r.stderr[-2000:])
        etype, seconds = r.value
        assert etype == "PeerLostError" and seconds < 1.0, (r.rank, r.value)


@pytest.mark.parametrize("mode", ["broadcast", "silent"])
def test_a_stall_raises_on_every_rank(mode):
    """Three ranks wait in the link for the fourth, which waits in the engine for a broadcast of
    theirs (rank 0's stall check raises StallError on every rank after SDP_STALL_SHUTDOWN_TIME)
    or does nothing (each waiting rank raises it itself, 2 s later, naming whom it waits for)."""
    n, env = fake_hosts([2, 2])
    values = check_ok(run_workers(n, "workers_hostlink:stall", [mode], env={"SDP_STALL_CHECK_TIME": "1",
                                                                           "SDP_STALL_SHUTDOWN_TIME": "2"},
                                  per_rank_env=env, timeout=60))
    for rank, (etype, msg, seconds) in enumerate(values if mode == "broadcast" else values[:3]):
        assert etype == "StallError" and seconds < 10, (rank, etype, msg)
        if mode == "silent":
            assert seconds >= 4 and "across hosts waited" in msg and f"for ranks [{[2, 0, 3][rank]}]" in msg, (rank, msg)


def test_malformed_link_messages_are_dropped_and_logged():
    n, env = fake_hosts([2, 2])
    results = run_workers(n, "workers_hostlink:malformed_link", [], per_rank_env=env, timeout=60)
    assert check_ok(results) == [[[4.0, 8.0, 12.0], 3]] * 4
    err = results[0].stderr
    assert err.count("dropping a malformed message on the leaders' link from rank 2") == 8, err[-3000:]


def test_a_late_rank_hands_the_position_from_the_compiled_entry_to_python():
    """A rank 30 ms late (each in turn): the others' compiled spins run out (2 ms locally, 10 ms
    for the other leader) and the position goes on in Python, exact on every rank."""
    n, env = fake_hosts([2, 2])
    for rank, (got, fast, compiled) in enumerate(
            check_ok(run_workers(n, "workers_hostlink:late_ranks", [], per_rank_env=env, timeout=60))):
        assert got == [10.0] * 4 and fast == 4, (rank, got, fast)
        # (each rank waits 28 ms or more in three of the four: Python finishes those)
        assert compiled <= 1 if _compiled_step() else compiled == 0, (rank, compiled)
