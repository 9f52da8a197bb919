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


def test_sdp_timeline_environment_variable(tmp_path):
    """SDP_TIMELINE=path: rank 0 writes a complete JSON array (closed at shutdown), one row per
    tensor; the other ranks write nothing unless SDP_TIMELINE_ALL_RANKS=1."""
    path = str(tmp_path / "env.json")
    values = check_ok(run_workers(2, "workers_collectives:timeline_from_env", [], env={"SDP_TIMELINE": path}))
    # (4 small arrays: one flattened group, named by its first name and count)
    assert {"NEGOTIATE", "QUEUE", "ALLREDUCE"} <= set(values[0]), values[0]
    assert any(v.startswith("e0 (+3) #") for v in values[0]), values[0]
    assert values[1] == []
    assert not (tmp_path / "env.json.rank1").exists()
