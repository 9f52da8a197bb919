"""Small allreduces across hosts inline with the negotiation (sdp.engine.inline): the framing and
rank 0's stash in one process, then real ranks on fake hosts (``SDP_HOSTNAME``) over TCP."""
import numpy as np
import pytest

from harness import check_ok, run_workers
from sdp.engine import inline
from test_errors_mp import MISMATCHES
from test_hierarchical_mp import fake_hosts


def test_framing_round_trip_and_plain_json():
    arrays = [np.arange(5, dtype=np.float32), np.array([7], np.int64), np.ones(3, np.float16)]
    body = inline.encode({"t": "req", "in": ["a", "b", "c"], "il": [a.nbytes for a in arrays]}, arrays)
    msg, tail = inline.decode(body)
    assert msg["in"] == ["a", "b", "c"] and len(tail) == sum(a.nbytes for a in arrays)
    cut = inline.pieces([[n, k] for n, k in zip(msg["in"], msg["il"])], tail)
    assert [np.frombuffer(c, a.dtype).tolist() for c, a in zip(cut, arrays)] == [a.tolist() for a in arrays]
    assert inline.decode(inline.encode({"t": "resp"}, [])) == ({"t": "resp"}, memoryview(b""))


@pytest.mark.parametrize("body", [b"I", b"I\xff\xff\xff\x7f{}", b"I\x05\x00\x00\x00{}", b"not json"])
def test_malformed_bodies_raise_value_error(body):
    with pytest.raises(ValueError):
        inline.decode(body)


@pytest.mark.parametrize("pairs", [[["a", 3]], [["a", 5], ["b", 0]], [["a", -1], ["b", 5]], [["a", "4"]], "x", [[1]]])
def test_lengths_must_add_up_to_the_bytes(pairs):
    assert inline.pieces(pairs, memoryview(b"abcd")) is None


def test_stash_waits_for_every_rank_drops_malformed_and_caps_each_rank():
    s = inline.Stash(3)
    s.add(1, {"in": ["x", "y"], "il": [4, 4]}, memoryview(b"aaaabbbb"))
    assert s.take("x") is None  # rank 2's bytes missing: the collective runs instead
    s.add(1, {"in": ["z"], "il": [4]}, memoryview(b"cccc"))
    s.add(2, {"in": ["z"], "il": [4]}, memoryview(b"dddd"))
    assert {q: bytes(v) for q, v in s.take("z").items()} == {1: b"cccc", 2: b"dddd"}
    s.add(2, {"in": ["w"], "il": [9]}, memoryview(b"eeee"))  # lengths do not match the bytes
    s.add(2, {"in": ["w", 3], "il": [2, 2]}, memoryview(b"eeee"))  # a name that is not a str
    assert "w" not in s.by_name
    big = memoryview(bytes(inline.STASH_BYTES // 2 + 1))
    s.add(1, {"in": ["p"], "il": [len(big)]}, big)
    s.add(1, {"in": ["q"], "il": [len(big)]}, big)  # over rank 1's cap: dropped
    assert "p" in s.by_name and "q" not in s.by_name and s.held[1] == len(big) + 4  # ("y" still waits)
    s.take("p")
    assert s.held[1] == 4


def _mixed_env(counts, off_rank):
    n, env = fake_hosts(counts)
    return n, lambda r: {**env(r), **({"SDP_FAST_LANE": "0"} if r == off_rank else {})}


@pytest.mark.parametrize("counts, off_rank", [([2, 2], None), ([1, 1, 1], None), ([2, 2], 3), ([2, 2], 0)])
def test_inline_results_and_who_decides(counts, off_rank):
    """Every op and dtype the inline path takes gives numpy's result, bit-identical on every rank;
    a rank that sends no bytes (its SDP_FAST_LANE=0), or rank 0 not inlining, sends every rank
    through the collective instead, all alike.  Control messages between the two ranks of a
    host go through the shared-memory rings (requests 1 -> 0, responses 0 -> 1), the others'
    over ZeroMQ."""
    n, env = _mixed_env(counts, off_rank)
    values = check_ok(run_workers(n, "workers_hierarchical:inline_cases", [], per_rank_env=env, timeout=120))
    for rank, (ok, digest, count, _) in enumerate(values):
        assert ok, rank
        assert digest == values[0][1], f"rank {rank} differs from rank 0"
        assert (count > 0) == (off_rank is None), (rank, count)
    if counts == [2, 2]:
        assert [v[3] for v in values] == [[1], [0], [], []]


def test_malformed_inline_bytes_are_dropped_and_logged():
    n, env = fake_hosts([1, 1])
    results = run_workers(n, "workers_hierarchical:malformed_inline", [], per_rank_env=env, timeout=60)
    assert check_ok(results) == [[[2.0, 4.0, 6.0], 3]] * 2
    err = results[0].stderr
    assert err.count("dropping malformed control message from rank 1") == 2, err[-3000:]
    assert "dropping malformed inline bytes from rank 1" in err, err[-3000:]


@pytest.mark.parametrize("kind", ["shape", "dtype", "op", "postscale"])
def test_mismatches_across_hosts_raise_on_every_rank(kind):
    """Small allreduces that would go inline still meet the coordinator's checks: every rank
    raises the same TensorMismatchError as on one host, and the engine goes on."""
    expect = dict(MISMATCHES)[kind]
    n, env = fake_hosts([1, 1])
    for rank, (etype, msg, seconds, still_works) in enumerate(
            check_ok(run_workers(n, "workers_errors:mismatch", [kind], per_rank_env=env, timeout=60))):
        assert (etype, msg) == ("TensorMismatchError", expect), rank
        assert seconds < 5 and still_works, rank
