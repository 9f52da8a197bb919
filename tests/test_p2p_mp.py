"""``sdp.send``/``sdp.recv`` (sdp.engine.p2p) between real rank processes: values at every size
(empty, 1 KB, several 4 MB pieces), the order of one peer's messages per tag, receives posted
before and after the sends, a size mismatch raised on the receiver only (the stream going on),
bad arguments, and a peer lost while a receive waits."""
import pytest

from harness import check_ok, run_cases, run_workers


@pytest.mark.parametrize("n", [2, 3])
def test_send_recv_values_order_and_mismatch(n):
    cases = [("ring", "workers_p2p:ring", []), ("order", "workers_p2p:in_order_per_tag", []),
             ("mismatch", "workers_p2p:mismatch", []), ("bad", "workers_p2p:bad_arguments", [])]
    runs = run_cases(n, cases, timeout=180)
    for key in ("ring", "order"):
        for rank, problems in enumerate(check_ok(runs[key])):
            assert not problems, (key, rank, problems)
    seen = check_ok(runs["mismatch"])[1]
    assert seen[0] == "TensorMismatchError" and seen[2], seen
    assert "recv on rank 1 from rank 0 (tag 9): rank 0 sent 12 bytes, rank 1's array holds 16 (float32[4])" \
        in seen[1], seen
    for rank, errors in enumerate(check_ok(runs["bad"])):
        assert all(e[0] == "ValueError" for e in errors), (rank, errors)
        assert f"send on rank {rank}: dst {rank} is not another rank of the job (0 to {n - 1}, not {rank})" \
            in errors[0][1], errors
        assert "tag -1 is not an int from 0 to 4294967295" in errors[3][1], errors
        assert "out must be a writeable C-contiguous numpy array" in errors[5][1], errors


def test_a_peer_lost_while_a_recv_waits_is_peer_lost_error():
    results = run_workers(2, "workers_p2p:peer_dies", [], timeout=90)
    etype, msg, seconds = results[0].value if results[0].ok else (results[0].error_type, results[0].error, None)
    assert etype == "PeerLostError" and "rank 1" in msg, (etype, msg, results[0].stderr[-2000:])
    assert seconds is None or seconds < 10, seconds
