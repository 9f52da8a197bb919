"""SDP_TIMELINE / start_timeline write a Chrome-trace JSON with each tensor's phases."""
from harness import check_ok, run_workers


def test_timeline_has_every_phase(tmp_path):
    path = str(tmp_path / "tl.json")
    pairs, unbalanced = check_ok(run_workers(2, "workers_collectives:timeline_run", [path]))[0]
    phases = {tuple(p) for p in pairs}
    names = {p for p, _ in phases}
    assert {"NEGOTIATE", "QUEUE", "FUSE", "ALLREDUCE", "UNPACK", "BROADCAST"} <= names, names
    assert all((p, "B") in phases and (p, "E") in phases for p in names)
    assert not unbalanced, unbalanced  # every phase that begins on a row ends on it
