"""The device path on a real GPU (marker ``gpu``): skipped, with the reason, without PyCUDA or a
CUDA device.  Two or four processes share the one GPU (each a fresh interpreter: never forked
after CUDA started).  Kinds: PyCUDA ``GPUArray``, CuPy, PyTorch, and raw DLPack capsules."""
import glob
import importlib.util

import pytest

from harness import check_ok, run_workers
import workers_device as w

pytestmark = [pytest.mark.gpu]
_why = ("PyCUDA is not installed" if importlib.util.find_spec("pycuda") is None
        else "no CUDA device (/dev/nvidia0)" if not glob.glob("/dev/nvidia[0-9]*") else None)
needs_gpu = pytest.mark.skipif(_why is not None, reason=_why or "")
# Staged results are checked bit for bit against the same collective on numpy arrays through the
# engine: a small host allreduce takes the fast lane otherwise, whose order of summation for more
# than two ranks is not the engine's (4 ranks: float32 SUM differed in the last bit, H200 run).
ENGINE = {"SDP_FAST_LANE": "0"}


def _have(mod):
    return importlib.util.find_spec(mod) is not None


def _check(values, cases):
    for rank, (out, counters) in enumerate(values):
        bad = [c for c, o in zip(cases, out) if o is not None and not o[0]]
        assert not bad, f"rank {rank}: wrong results for {bad[:5]}"
    for i, c in enumerate(cases):
        if c[0] in ("allreduce", "broadcast") and values[0][0][i] is not None:
            assert len({v[0][i][1] for v in values}) == 1, c


@needs_gpu
def test_kernels_against_numpy_for_every_op_and_dtype():
    bad, ran = check_ok(run_workers(1, "workers_device:kernel_matrix", [], init=False, timeout=300))[0]
    assert ran > 400 and not bad, bad


@needs_gpu
@pytest.mark.parametrize("kind, n, ipc, lane", [("cupy", 2, "1", "1"), ("cupy", 2, "1", "0"), ("gpuarray", 2, "1", "1"),
                                                ("torch", 2, "1", "1"), ("capsule", 2, "1", "1"), ("cupy", 4, "1", "1"),
                                                ("cupy", 2, "0", "0"), ("torch", 4, "0", "0")])
def test_collectives_of_device_arrays(kind, n, ipc, lane):
    """IPC: against the reference arithmetic, through the engine thread (lane "0") or with the
    fast lane running synchronous allreduces in the calling thread; staged: against the engine's
    host collectives."""
    if kind in ("cupy", "capsule") and not _have("cupy") or kind == "torch" and not _have("torch"):
        pytest.skip(f"{kind} is not installed")
    cases = w.matrix()
    res = run_workers(n, "workers_device:device_matrix", [kind, cases, "reference" if ipc == "1" else "host"],
                      env={"SDP_GPU_IPC": ipc, "SDP_FAST_LANE": lane}, timeout=300)
    values = check_ok(res)
    _check(values, cases)
    for r in res:  # shutdown freed every CUDA object in its context, none was left to the exit
        assert "could not be cleaned up" not in r.stderr, (r.rank, r.stderr[-2000:])
    for _, counters in values:
        assert counters["ipc"] is (ipc == "1") and counters["backend"] == "cuda"
        assert (counters["lane"] > 0) is (lane == "1"), counters
        if ipc == "1":
            assert counters["d2h"] == 0, counters  # the IPC path never copies to the host


@needs_gpu
@pytest.mark.parametrize("kind, n", [("cupy", 2), ("torch", 2), ("cupy", 4)])
def test_synchronous_device_allreduces_in_the_calling_thread(kind, n):
    """The fast lane's device allreduces (tests/test_device.py's test of the same name, on the GPU)."""
    if kind == "cupy" and not _have("cupy") or kind == "torch" and not _have("torch"):
        pytest.skip(f"{kind} is not installed")
    env = {"SDP_FAST_LANE": "1", "SDP_FUSION_THRESHOLD": str(1 << 20)}
    for r, (oks, counters, counts) in enumerate(check_ok(run_workers(n, "workers_device:lane_device",
                                                                     [kind, 1 << 19], env=env, timeout=120))):
        assert len(oks) == 23 and all(oks), (r, oks)
        assert counters["lane"] >= 1 and counters["d2h"] == 0, (r, counters, counts)


@needs_gpu
def test_fused_bucket_and_errors():
    kind = "cupy" if _have("cupy") else "gpuarray"
    for n in (2, 4):  # one shot; two shots (25.6 MB > ONE_SHOT_BYTES)
        for ok, counters in check_ok(run_workers(n, "workers_device:fused_bucket", [kind, 100, 65536])):
            assert ok and counters["d2h"] == 0
    for msgs in check_ok(run_workers(2, "workers_device:mismatch", [kind], timeout=60)):
        assert "memory (host or device) mismatch" in msgs[0] and "shape mismatch" in msgs[1], msgs
    res = run_workers(2, "workers_device:killed_peer", [kind], timeout=60)
    err, seconds = res[0].value
    assert err == "PeerLostError" and seconds < 15, (err, seconds, res[0].stderr[-2000:])


@needs_gpu
@pytest.mark.parametrize("kind, n, ipc", [("cupy", 2, "1"), ("cupy", 4, "1"), ("torch", 2, "1"),
                                          ("gpuarray", 2, "1"), ("cupy", 2, "0")])
def test_grouped_device_tensors(kind, n, ipc):
    """``grouped_allreduce`` of device tensors as one request per dtype (issue 27's fused list),
    bit-exact, each part of its own kind; then the group mismatches on every rank."""
    if kind == "cupy" and not _have("cupy") or kind == "torch" and not _have("torch"):
        pytest.skip(f"{kind} is not installed")
    for oks, negotiated, counters in check_ok(run_workers(n, "workers_device:device_groups", [kind],
                                                          env={"SDP_GPU_IPC": ipc}, timeout=120)):
        assert len(oks) == 16 and all(oks) and len(negotiated) == 4, (oks, negotiated)
        assert (counters["d2h"] == 0) is (ipc == "1"), counters
    for msgs in check_ok(run_workers(2, "workers_device:device_group_mismatch", [kind], timeout=60)):
        assert "shapes of the grouped tensors mismatch" in msgs[0] and "rank 0 has device" in msgs[1], msgs


@needs_gpu
@pytest.mark.parametrize("ipc", ["1", "0"])
def test_fp16_compression_on_the_device(ipc):
    """float32 -> float16 on the device, allreduced as float16 (IPC or staged), back to float32."""
    if not _have("cupy"):
        pytest.skip("cupy is not installed")
    for ok, dtype, counters in check_ok(run_workers(2, "workers_device:fp16_compressed", ["cupy"],
                                                    env={"SDP_GPU_IPC": ipc})):
        assert ok and dtype == "float16" and counters["ipc"] is (ipc == "1"), (ok, dtype, counters)


@needs_gpu
def test_device_allreduce_across_fake_hosts():
    """2 fake hosts x 2 ranks on the one GPU: per-host windows, parts across hosts (hierarchical)."""
    if not _have("cupy"):
        pytest.skip("cupy is not installed")
    from test_hierarchical_mp import fake_hosts
    n, per_rank = fake_hosts([2, 2])
    cases = [c for c in w.matrix() if c[1] in ("float16", "float32", "int32")]
    values = check_ok(run_workers(n, "workers_device:device_matrix", ["cupy", cases, "host"],
                                  env=ENGINE, per_rank_env=per_rank, timeout=300))
    _check(values, cases)
    for _, counters in values:
        assert counters["hierarchical"] and counters["kernels"] > 0, counters


@needs_gpu
def test_staged_allreduce_across_fake_hosts_segment_by_segment():
    """2 fake hosts x 1 rank on the one GPU: lone allreduces through a page-locked host buffer,
    copied from and to the device segment by segment as the ring moves them."""
    if not _have("cupy"):
        pytest.skip("cupy is not installed")
    from test_hierarchical_mp import fake_hosts
    n, per_rank = fake_hosts([1, 1])
    for oks, counters in check_ok(run_workers(n, "workers_device:staged_slabs", ["cupy", (1 << 20) + 3],
                                              env={**ENGINE, "SDP_SEGMENT_BYTES": str(64 << 10)},
                                              per_rank_env=per_rank, timeout=120)):
        assert oks == [True, True, True] and counters["ipc"] is False and counters["d2h"] > 0, (oks, counters)
