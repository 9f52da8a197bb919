"""The fast lane's compiled step (sdp.engine.native, sdp/engine/cc/lane_now.c): built into the
cache once, found there again, and never needed: without a compiler, or with a broken library in
the cache, the lane runs in Python with the same results."""
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness import check_ok, run_workers
from sdp.common import native_build

needs_compiler = pytest.mark.skipif(
    native_build.compiler("CC", ("gcc", "cc", "clang")) is None
    or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
    reason="no C compiler or no Python.h here")


def _cli(cache: Path, *args):
    env = {"SDP_CACHE_DIR": str(cache), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "sdp.engine.native", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@needs_compiler
def test_the_command_line_builds_into_the_cache_then_finds_it(tmp_path):
    path = Path(_cli(tmp_path, "--print-path").stdout.strip())
    assert path.parent == tmp_path / "native" and not path.exists()
    first = _cli(tmp_path)
    assert first.returncode == 0 and first.stdout.strip() == f"sdp: built {path}", first
    assert path.exists() and path.stat().st_mode & 0o777 == 0o755
    again = _cli(tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == f"sdp: cached {path}", again
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []  # (nothing half-built left)


def test_a_missing_compiler_fails_the_command_line_with_the_reason(tmp_path):
    res = subprocess.run([sys.executable, "-m", "sdp.engine.native"], capture_output=True, text=True, timeout=60,
                         env={"SDP_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc"),
                              "PATH": "/usr/bin:/bin"})
    assert res.returncode == 1 and "no C compiler" in res.stderr, res


@pytest.mark.parametrize("how", ["no compiler", "a broken library in the cache"])
def test_the_lane_runs_in_python_without_the_compiled_step(tmp_path, how):
    env = {"SDP_CACHE_DIR": str(tmp_path)}
    if how == "no compiler":
        env["CC"] = str(tmp_path / "no-such-cc")
    else:
        path = Path(_cli(tmp_path, "--print-path").stdout.strip())
        path.parent.mkdir(parents=True)
        path.write_bytes(b"not a shared library")
    for bad, _, calls, entered, counts in check_ok(run_workers(2, "workers_lane:edges", [3], env=env, timeout=120)):
        assert not bad and calls == 0 and entered == 0 and counts["fast"] == 200, (bad, calls, entered, counts)
    for ok, after_bursts, _, joined, bad in check_ok(run_workers(2, "workers_lane_flow:bursts", [4], env=env,
                                                                 timeout=120)):
        assert ok and joined >= 2 * 39 and len(bad) == 2, (after_bursts, joined, bad)  # (Lane.burst in Python)
    for msg, ok in check_ok(run_workers(2, "workers_lane_flow:burst_mismatch", [20], env=env, timeout=60)):
        assert ok and "'m3'" in msg, msg  # (rank 0 decides the batch's positions at once, in Python)


@needs_compiler
def test_part_handles_are_made_as_the_class_makes_them():
    """``part_handles`` (a group's handles, as ``Context.burst`` makes one) sets PartHandle's slots
    without calling it; a class without those slots is called."""
    from sdp.engine import native
    from sdp.engine.handles import Handle, PartHandle
    module = native.load()
    assert module is not None
    group = Handle("g")
    hs = module.part_handles(PartHandle, ["a", "b", "c"], group)
    assert [type(h) for h in hs] == [PartHandle] * 3
    assert [(h.name, h._group, h._index) for h in hs] == [("a", group, 0), ("b", group, 1), ("c", group, 2)]
    group._set(result=["ra", "rb", "rc"])
    assert [h.wait() for h in hs] == ["ra", "rb", "rc"] and all(h.done() for h in hs)

    class Plain:
        def __init__(self, name, group, index):
            self.args = (name, group, index)
    assert [p.args for p in module.part_handles(Plain, ["x", "y"], group)] == [("x", group, 0), ("y", group, 1)]
