"""The device path without a GPU: the numpy backend (host memory in /dev/shm windows standing in
for device memory) runs the same IPC and host-staged algorithms over real processes, and the
DLPack / ``__cuda_array_interface__`` readers are checked with numpy's own capsules and fakes."""
import subprocess
import sys
import types

import numpy as np
import pytest

from harness import check_ok, run_workers
import workers_device as w
from sdp.common.reduce_ops import ReduceOp
from sdp.engine import device_arrays
from sdp.engine.backends import reduce_arrays

# (the fast lane off: device results are checked bit for bit against the same collectives on
# host arrays through the engine, whose shared-memory reduction adds in another order than the
# lane's rank order with 3 or more ranks)
NUMPY = {"SDP_DEVICE_BACKEND": "numpy", "SDP_FAST_LANE": "0"}


def _check(values, cases):
    for rank, (out, counters) in enumerate(values):
        bad = [c for c, o in zip(cases, out) if o is not None and not o[0]]
        assert not bad, f"rank {rank}: wrong results for {bad[:5]}"
    for i, c in enumerate(cases):  # every rank holds the same bits (allreduce, broadcast)
        if c[0] in ("allreduce", "broadcast"):
            assert len({v[0][i][1] for v in values}) == 1, c


@pytest.mark.parametrize("n, ipc, lane", [(1, "1", "0"), (2, "1", "0"), (3, "1", "0"), (2, "1", "1"), (3, "1", "1"),
                                          (2, "0", "0"), (4, "0", "0")])
def test_every_collective_dtype_op_and_scale(n, ipc, lane):
    """IPC path: bit-exact against the reference arithmetic, no device-to-host byte, through
    the engine thread and with the fast lane (synchronous allreduces in the calling thread);
    host-staged path: bit-exact against the same collective on numpy arrays."""
    cases = w.matrix()
    values = check_ok(run_workers(n, "workers_device:device_matrix",
                                  ["fake", cases, "reference" if ipc == "1" else "host"],
                                  env={**NUMPY, "SDP_GPU_IPC": ipc, "SDP_FAST_LANE": lane}, timeout=240))
    _check(values, cases)
    for _, counters in values:
        assert counters["ipc"] is (ipc == "1") and counters["backend"] == "numpy"
        assert (counters["lane"] > 0) is (lane == "1"), counters
        if ipc == "1":
            assert counters["d2h"] == 0 and counters["h2d"] == 0 and counters["kernels"] > 0
        else:
            assert counters["d2h"] > 0 and counters["kernels"] == 0


def test_dlpack_producers_take_the_same_path():
    cases = [c for c in w.matrix() if c[1] in ("float16", "bfloat16", "int32")]
    _check(check_ok(run_workers(2, "workers_device:device_matrix", ["fakedl", cases], env=NUMPY)), cases)


@pytest.mark.parametrize("n, elems", [(2, 1000), (3, 1000), (3, 4000)])
def test_fused_bucket_of_many_tensors(n, elems):
    """One shot (2 ranks; 3 ranks, 400 KB) and two shots (3 ranks, 1.6 MB > ONE_SHOT_BYTES)."""
    for ok, counters in check_ok(run_workers(n, "workers_device:fused_bucket", ["fake", 100, elems], env=NUMPY)):
        assert ok and counters["d2h"] == 0


@pytest.mark.parametrize("n, env, ranks", [(2, {}, None), (3, {}, None), (2, {"SDP_GPU_IPC": "0"}, None),
                                            (3, {}, [0, 2])])
def test_grouped_device_tensors_go_as_one_request_per_dtype_and_kind(n, env, ranks):
    """IPC (one and two shots), host-staged and a process set: each part bit-exact and of its own
    kind, and the engine negotiated one request per group (float32, float16, the DLPack parts),
    not one per tensor (issue 27: 100 x 256 KB fused)."""
    values = check_ok(run_workers(n, "workers_device:device_groups", ["fake", ranks], env={**NUMPY, **env}))
    for r, (oks, negotiated, counters) in enumerate(values):
        if ranks and r not in ranks:
            continue
        assert len(oks) == 16 and all(oks), (r, oks)
        assert len(negotiated) == 6 and all(" (+" in k for k in negotiated), negotiated
        staged = bool(ranks) or env.get("SDP_GPU_IPC") == "0"  # (a process set's collectives are staged)
        assert (counters["d2h"] > 0) is staged and counters["ipc"] is (env.get("SDP_GPU_IPC") != "0"), counters


@pytest.mark.parametrize("lane", ["0", "1"])
def test_device_group_mismatches_raise_on_every_rank(lane):
    """(With the fast lane on, rank 1's host group would run whole in the lane: it must meet
    rank 0's device group in the engine instead.)"""
    env = {**NUMPY, "SDP_FAST_LANE": lane}
    for msgs in check_ok(run_workers(2, "workers_device:device_group_mismatch", ["fake"], env=env, timeout=60)):
        assert "'gshape.0 (+5) #" in msgs[0] and "shapes of the grouped tensors mismatch" in msgs[0], msgs
        assert "rank 1 has [[5], [5], [5], [6], [5], [5]]" in msgs[0], msgs
        assert "memory (host or device) mismatch, rank 0 has device, rank 1 has host" in msgs[1], msgs


@pytest.mark.parametrize("pool", [str(128 << 20), "0"])
def test_staged_allreduce_slab_by_slab(pool):
    """A lone device tensor staged through 16 KB slabs of shared memory, results in the pool
    (peers write them directly) or on the heap (copied out of the segments)."""
    env = {**NUMPY, "SDP_GPU_IPC": "0", "SDP_SHM_SLAB_BYTES": "16384", "SDP_SHM_POOL_BYTES": pool}
    for oks, counters in check_ok(run_workers(3, "workers_device:staged_slabs", ["fake", 30001], env=env)):
        assert oks == [True, True, True] and counters["ipc"] is False and counters["kernels"] == 0, (oks, counters)


@pytest.mark.parametrize("counts", [[1, 1], [1, 1, 1]])
def test_staged_allreduce_across_hosts_segment_by_segment(counts):
    """One rank per (fake) host: a lone device tensor's allreduce goes over the mesh in a host
    buffer, each segment copied from the device as the ring first sends it and back as it is
    final (4 KB segments: 30 of them for 30001 float32); bit for bit against the same allreduce
    of numpy arrays."""
    from test_hierarchical_mp import fake_hosts
    n, per_rank = fake_hosts(counts)
    env = {**NUMPY, "SDP_SEGMENT_BYTES": "4096"}
    for oks, counters in check_ok(run_workers(n, "workers_device:staged_slabs", ["fake", 30001], env=env,
                                              per_rank_env=per_rank)):
        assert oks == [True, True, True] and counters["ipc"] is False and counters["kernels"] == 0, (oks, counters)


@pytest.mark.parametrize("counts", [[2, 2], [2, 1, 2]])
def test_device_allreduce_across_hosts_is_hierarchical(counts):
    """Ranks on several (fake) hosts: each host's ranks share windows, each part is reduced on
    the device by its owner and allreduced with its owners on the other hosts; bit-exact against
    the same collectives on numpy arrays (the host hierarchy), every other collective staged."""
    from test_hierarchical_mp import fake_hosts
    n, per_rank = fake_hosts(counts)
    cases = w.matrix()
    values = check_ok(run_workers(n, "workers_device:device_matrix", ["fake", cases, "host"], env=NUMPY,
                                  per_rank_env=per_rank, timeout=240))
    _check(values, cases)
    for _, counters in values:
        assert counters["hierarchical"] and counters["kernels"] > 0 and counters["d2h"] > 0, counters


@pytest.mark.parametrize("n", [2, 3])
def test_synchronous_device_allreduces_run_in_the_calling_thread(n):
    """With the fast lane on, a synchronous device allreduce of every rank is agreed through the
    lane and reduced by the caller from the lane's own windows (no engine round): bit-exact
    whether it ran there, was held for a late rank or went to the engine, with windows grown
    by the engine in between (1 MB fusion threshold: 1 MB windows, then a 2 MB allreduce)."""
    env = {**NUMPY, "SDP_FAST_LANE": "1", "SDP_FUSION_THRESHOLD": str(1 << 20)}
    for r, (oks, counters, counts) in enumerate(check_ok(run_workers(n, "workers_device:lane_device",
                                                                     ["fake", 1 << 19], env=env, timeout=120))):
        assert len(oks) == 23 and all(oks), (r, oks)
        # (on a quiet machine 8 with 2 ranks, 7 with 3: the six in step, the group and the one
        # after the windows grew, 2 ranks only; a rank late past ESCALATE_S, as the 20 ms one is
        # and any may be on a busy machine, sends its call to the engine)
        assert counters["lane"] >= 1 and counters["d2h"] == 0, (r, counters, counts)
        assert counts["fast"] >= counters["lane"], (r, counters, counts)


@pytest.mark.parametrize("lane", ["0", "1"])
def test_host_and_device_arrays_for_one_name_is_a_mismatch_on_every_rank(lane):
    env = {**NUMPY, "SDP_FAST_LANE": lane}
    for msgs in check_ok(run_workers(2, "workers_device:mismatch", ["fake"], env=env, timeout=60)):
        assert "memory (host or device) mismatch, rank 0 has device, rank 1 has host" in msgs[0], msgs
        assert "shape mismatch" in msgs[1] and "rank 1 has [5]" in msgs[1], msgs


@pytest.mark.parametrize("lane", ["0", "1"])
def test_killed_peer_during_device_collectives_is_reported(lane):
    res = run_workers(2, "workers_device:killed_peer", ["fake"], env={**NUMPY, "SDP_FAST_LANE": lane}, timeout=60)
    err, seconds = res[0].value
    assert err == "PeerLostError" and seconds < 15, (err, seconds, res[0].stderr[-2000:])


@pytest.mark.parametrize("lane", ["0", "1"])
def test_a_device_error_on_one_rank_fails_every_rank(lane):
    """A device reduction that fails on rank 1 (through the engine thread, or in the calling
    thread with the fast lane) is an sdp error there, and every peer raises within the usual
    bounds, told why."""
    res = check_ok(run_workers(2, "workers_device:device_error", ["fake"], env={**NUMPY, "SDP_FAST_LANE": lane},
                               timeout=60))
    for r, (err, seconds, msg) in enumerate(res):
        assert err in ("SdpError", "PeerLostError") and seconds < 15, (r, err, seconds, msg)
    assert res[1][0] == "SdpError" and "simulated device error" in res[1][2], res[1]
    assert "simulated device error" in res[0][2], res[0]


def test_reference_arithmetic_scales_16_bit_floats_in_float32():
    """A factor not representable in float16 is not rounded first (Horovod scales in float32)."""
    x = np.array([1.0, 3.0, 1000.0, -7.5], np.float16)
    got = reduce_arrays([x, x], ReduceOp.SUM, prescale=0.1, scale=1 / 3)
    pre = (x.astype(np.float32) * np.float32(0.1)).astype(np.float16).astype(np.float32)
    assert np.array_equal(got, ((pre + pre) * np.float32(1 / 3)).astype(np.float16))
    assert not np.array_equal(got, ((x * np.float16(0.1)) * 2 * np.float16(1 / 3)).astype(np.float16))


def test_host_dlpack_producers_are_read_with_from_dlpack_and_given_back_as_their_kind():
    """Issue 54: an object with ``__dlpack__`` / ``__dlpack_device__`` in host memory (not a numpy
    array) went in as a 0-d object array ("dtype object is not supported")."""
    base = np.arange(6, dtype=np.float32)
    want = {"allreduce": base * 3, "allreduce_avg": base * 1.5, "allgather": np.concatenate([base, base * 2]),
            "broadcast": base * 2, "reducescatter": None, "alltoall": None}
    for r, v in enumerate(check_ok(run_workers(2, "workers_host_dlpack:host_producers", []))):
        assert {k: t for k, (t, _) in v.items()} == dict.fromkeys(want, "HostProducer"), v
        for k, values in want.items():
            if values is not None:
                np.testing.assert_allclose(v[k][1], values, err_msg=k)
        np.testing.assert_allclose(v["reducescatter"][1], (base * 3)[3 * r:3 * r + 3])
        np.testing.assert_allclose(v["alltoall"][1], np.concatenate([base[3 * r:3 * r + 3], base[3 * r:3 * r + 3] * 2]))


def test_numpy_cpu_capsules_read_as_host_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    cap = a.__dlpack__()
    assert device_arrays.device_tensor(cap) is None or True  # a CPU capsule is not a device array
    arr = device_arrays.host_array(a.__dlpack__())
    assert np.array_equal(arr, a)


def test_capsules_we_make_round_trip_through_numpy_and_keep_their_owner_alive():
    import gc
    a = np.arange(10, dtype=np.int16)
    cap = device_arrays.make_capsule(a.ctypes.data, a.shape, a.dtype, device_arrays.KDL_CPU, 0, a)
    back = device_arrays.host_array(cap)
    del a, cap
    gc.collect()
    assert back.tolist() == list(range(10))
    t, host = device_arrays.consume_capsule(
        device_arrays.make_capsule(back.ctypes.data, (2, 5), np.dtype(np.int16), device_arrays.KDL_CUDA, 3, back))
    assert host is None and t.shape == (2, 5) and t.device_id == 3 and t.ptr == back.ctypes.data
    t.release()


def test_cuda_array_interface_reader_checks_layout():
    class Strided:
        __cuda_array_interface__ = {"shape": (4, 4), "typestr": "<f4", "data": (1 << 20, False),
                                    "strides": (4, 16), "version": 3, "stream": 7}

    with pytest.raises(ValueError, match="C-contiguous"):
        device_arrays.device_tensor(Strided())
    Strided.__cuda_array_interface__ = dict(Strided.__cuda_array_interface__, strides=(16, 4))
    t = device_arrays.device_tensor(Strided())
    assert (t.shape, t.dtype, t.ptr, t.stream, t.nbytes) == ((4, 4), np.float32, 1 << 20, 7, 64)


class _CupyLike:
    """What :func:`device_arrays.device_tensors` reads of a CuPy array (its attributes and both
    interfaces), over host memory; registered as ``cupy.ndarray`` for the test."""

    def __init__(self, arr, stream):
        self.arr, self.stream = arr, stream
        self.shape, self.dtype = arr.shape, arr.dtype
        self.flags = types.SimpleNamespace(c_contiguous=arr.flags.c_contiguous)
        self._c_contiguous = arr.flags.c_contiguous  # (CuPy's own flag, which flags.c_contiguous returns)
        self.data = types.SimpleNamespace(ptr=arr.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.arr.ctypes.data, False),
                "strides": None if self.arr.flags.c_contiguous else self.arr.strides, "version": 3,
                "stream": self.stream}

    def __dlpack_device__(self):
        return 2, 0

    def __dlpack__(self, stream=None):  # (only for what the interface cannot name: bfloat16)
        assert self.dtype.kind == "V", "read through __cuda_array_interface__"
        return device_arrays.make_capsule(self.arr.ctypes.data, self.shape, self.dtype, device_arrays.KDL_CUDA, 0,
                                          self)


def test_a_list_of_cupy_arrays_reads_as_each_alone(monkeypatch):
    """``device_tensors`` (a fused list: CuPy arrays after the first read from their attributes)
    gives what ``device_tensor`` gives each array, the first one's stream for all, and the same
    error for a non-contiguous array."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=_CupyLike))
    host = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5, np.float16), np.zeros((), np.int64),
            np.ones((2, 0), np.float32), np.ones(3, w.np_dtype("bfloat16"))]
    objs = [_CupyLike(a, 7) for a in host] + [w.FakeDevice(host[0]), host[1], _CupyLike(host[0], 7)]
    fields = ("ptr", "shape", "dtype", "device_id", "kind", "stream", "nbytes", "size", "ndim")
    got = device_arrays.device_tensors(objs)
    for o, t in zip(objs, got):
        want = device_arrays.device_tensor(o)
        assert (t is None) == (want is None)
        if t is not None:
            assert [getattr(t, f) for f in fields] == [getattr(want, f) for f in fields] and t.source is o
    assert got[6] is None and got[3].nbytes == 0 and got[2].shape == () and got[4].stream is None
    strided = objs[:2] + [_CupyLike(host[0].T, 7)]
    for fn in (device_arrays.device_tensors, lambda xs: [device_arrays.device_tensor(x) for x in xs]):
        with pytest.raises(ValueError, match="C-contiguous"):
            fn(strided)


def test_nothing_imports_pycuda_without_a_device_array():
    code = ("import sys, numpy as np, sdp, sdp.api, sdp.engine.device_path, sdp.engine.runtime\n"
            "assert 'pycuda' not in sys.modules, sorted(m for m in sys.modules if 'cuda' in m)\nprint('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


@pytest.mark.parametrize("ipc", ["1", "0"])
def test_a_joined_rank_contributes_device_zeros(ipc):
    values = check_ok(run_workers(2, "workers_device:join_with_device_arrays", ["fake"],
                                  env={**NUMPY, "SDP_GPU_IPC": ipc}, timeout=60))
    assert values[0] == [True, True, True, 0] and values[1] == [0], values


def test_tf_face_sends_gpu_tensors_as_capsules_and_takes_capsules_back():
    """The TF face's eager route: CPU tensors go as numpy views; a capsule result (what the device
    path returns for a GPU tensor's capsule) comes back as a tensor (CPU capsules here)."""
    tf = pytest.importorskip("tensorflow")
    from sdp.tensorflow import ops
    t = tf.constant([1.0, 2.0, 3.0])
    assert isinstance(ops.eager_input(t), np.ndarray)
    back = ops._to_tensor(tf.experimental.dlpack.to_dlpack(t * 2), tf.float32)
    assert back.numpy().tolist() == [2.0, 4.0, 6.0]
    assert device_arrays.device_tensor(tf.experimental.dlpack.to_dlpack(t)) is None  # a CPU capsule: host path


@pytest.mark.parametrize("n, env, ranks", [(2, {}, None), (2, {"SDP_SHM_SLAB_BYTES": "0"}, None), (3, {}, [0, 2])])
def test_host_paths_scale_16_bit_floats_in_float32(n, env, ranks):
    """Shared memory, ZeroMQ only, and a process set: 16-bit floats scaled in float32 (before: the
    factor was rounded to float16 first, and reducescatter rounded before scaling)."""
    for r, oks in enumerate(check_ok(run_workers(n, "workers_device:host_16bit_scaling", [ranks], env=env))):
        assert all(oks) and (len(oks) == 4 or ranks and r not in ranks), (r, oks)
