"""Settings from the environment (sdp.common.config) and SMDDP's bucket_cap_mb."""
import math

import pytest

from harness import check_ok, run_workers
from sdp.common.config import DEFAULT_FUSION_THRESHOLD, Config, bucket_cap_mb_to_bytes

# (SDP name, Horovod fallback or None, Config field, a valid raw value, what it parses to)
VARS = [
    ("SDP_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", "fusion_threshold", "1048576", 1048576),
    ("SDP_CYCLE_TIME", "HOROVOD_CYCLE_TIME", "cycle_time_ms", "2.5", 2.5),
    ("SDP_TIMEOUT", None, "timeout_s", "12", 12.0),
    ("SDP_START_TIMEOUT", "HOROVOD_START_TIMEOUT", "start_timeout_s", "7.5", 7.5),
    ("SDP_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_check_s", "3", 3.0),
    ("SDP_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_s", "90", 90.0),
    ("SDP_PEER_TIMEOUT", None, "peer_timeout_s", "2.5", 2.5),
    ("SDP_SEGMENT_BYTES", None, "segment_bytes", "65536", 65536),
    ("SDP_SHM_SLAB_BYTES", None, "shm_slab_bytes", "4096", 4096),
    ("SDP_SHM_POOL_BYTES", None, "shm_pool_bytes", "8192", 8192),
    ("SDP_TIMELINE", "HOROVOD_TIMELINE", "timeline", "/tmp/tl.json", "/tmp/tl.json"),
    ("SDP_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY", "cache_capacity", "16", 16),
]
NUMERIC = [v for v in VARS if v[0] != "SDP_TIMELINE"]
FALLBACKS = [v for v in VARS if v[1]]
INT_VARS = ["SDP_FUSION_THRESHOLD", "SDP_SEGMENT_BYTES", "SDP_SHM_SLAB_BYTES", "SDP_SHM_POOL_BYTES", "SDP_CACHE_CAPACITY"]
ALL_NAMES = [n for v in VARS for n in v[:2] if n]


def _ids(vs):
    return [v[0] for v in vs]


def test_defaults():
    cfg = Config.from_env({})
    assert cfg.fusion_threshold == 26214400 == 25 * 1024 * 1024 == DEFAULT_FUSION_THRESHOLD
    assert cfg.cycle_time_ms == 0
    assert cfg.timeout_s == 300 and cfg.start_timeout_s == 60
    assert cfg.stall_check_s == 60
    assert cfg.stall_shutdown_s == 0  # off
    assert cfg.peer_timeout_s == 30
    assert cfg.segment_bytes == 1 << 20
    assert cfg.shm_slab_bytes == 32 << 20 and cfg.shm_pool_bytes == 128 << 20
    assert cfg.timeline is None
    assert cfg == Config()  # the dataclass defaults agree with from_env's


def test_reads_os_environ_without_an_argument(monkeypatch):
    for name in ALL_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SDP_FUSION_THRESHOLD", "4096")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    cfg = Config.from_env()
    assert (cfg.fusion_threshold, cfg.cycle_time_ms, cfg.stall_check_s) == (4096, 3.0, 60.0)


@pytest.mark.parametrize("sdp_name, hvd_name, field, raw, value", VARS, ids=_ids(VARS))
def test_sdp_variable_overrides(sdp_name, hvd_name, field, raw, value):
    cfg = Config.from_env({sdp_name: raw})
    got = getattr(cfg, field)
    assert got == value and type(got) is type(value)
    assert got != getattr(Config(), field)
    # nothing else moved
    assert {k: v for k, v in vars(cfg).items() if k != field} == \
        {k: v for k, v in vars(Config()).items() if k != field}


@pytest.mark.parametrize("sdp_name, hvd_name, field, raw, value", FALLBACKS, ids=_ids(FALLBACKS))
def test_horovod_fallback(sdp_name, hvd_name, field, raw, value):
    assert getattr(Config.from_env({hvd_name: raw}), field) == value
    # an empty SDP_* value counts as unset
    assert getattr(Config.from_env({sdp_name: "", hvd_name: raw}), field) == value


@pytest.mark.parametrize("sdp_name, hvd_name, field, raw, value", FALLBACKS, ids=_ids(FALLBACKS))
def test_sdp_wins_over_horovod(sdp_name, hvd_name, field, raw, value):
    other = "/tmp/other.json" if field == "timeline" else "5"
    assert getattr(Config.from_env({sdp_name: raw, hvd_name: other}), field) == value
    # ... even when the Horovod value is unusable: it is not read at all
    assert getattr(Config.from_env({sdp_name: raw, hvd_name: "abc"}), field) == value


@pytest.mark.parametrize("name", [n for v in NUMERIC for n in v[:2] if n])
def test_unparsable_value_names_variable_and_value(name):
    with pytest.raises(ValueError) as e:
        Config.from_env({name: "abc"})
    assert name in str(e.value) and "'abc'" in str(e.value)


@pytest.mark.parametrize("name", INT_VARS)
def test_byte_counts_must_be_integers(name):
    with pytest.raises(ValueError, match=f"{name}='1.5'"):
        Config.from_env({name: "1.5"})


@pytest.mark.parametrize("name", [n for v in NUMERIC for n in v[:2] if n])
def test_negative_value_rejected(name):
    with pytest.raises(ValueError, match=f"{name}='-1'.*>= 0"):
        Config.from_env({name: "-1"})


@pytest.mark.parametrize("name, raw", [("SDP_FUSION_THRESHOLD", "-1"), ("SDP_CYCLE_TIME", "-5"),
                                       ("HOROVOD_CYCLE_TIME", "-0.5"), ("SDP_STALL_SHUTDOWN_TIME", "-1e-3"),
                                       ("SDP_TIMEOUT", "nan")])
def test_negative_or_nan_examples(name, raw):
    with pytest.raises(ValueError) as e:
        Config.from_env({name: raw})
    assert name in str(e.value) and repr(raw) in str(e.value)


@pytest.mark.parametrize("name, field", [("SDP_FUSION_THRESHOLD", "fusion_threshold"),  # no fusion
                                         ("HOROVOD_FUSION_THRESHOLD", "fusion_threshold"),
                                         ("SDP_CYCLE_TIME", "cycle_time_ms"),
                                         ("SDP_STALL_SHUTDOWN_TIME", "stall_shutdown_s"),  # off
                                         ("SDP_PEER_TIMEOUT", "peer_timeout_s"),  # silent peers never lost
                                         ("SDP_SHM_SLAB_BYTES", "shm_slab_bytes"),  # no shared memory
                                         ("SDP_SHM_POOL_BYTES", "shm_pool_bytes")])
def test_zero_is_valid(name, field):
    assert getattr(Config.from_env({name: "0"}), field) == 0


# ---- bucket_cap_mb (SMDDP: bucket_cap_mb * 1024 * 1024 must be a multiple of 128 bytes) ----------
@pytest.mark.parametrize("mb, nbytes", [(25, 26214400), (1, 1 << 20), (0.5, 524288),
                                        (128 / 2 ** 20, 128), (0, 0)])
def test_bucket_cap_mb_valid(mb, nbytes):
    got = bucket_cap_mb_to_bytes(mb)
    assert got == nbytes and type(got) is int


def test_bucket_cap_mb_default_is_the_default_threshold():
    assert bucket_cap_mb_to_bytes(25) == Config.from_env({}).fusion_threshold


@pytest.mark.parametrize("mb", [100 / 2 ** 20,  # 100 bytes: whole, not a multiple of 128
                                1e-9,  # 0.001 bytes: not whole
                                (128 + 0.5) / 2 ** 20,  # 128.5 bytes
                                -1, -0.5, -128 / 2 ** 20,  # negative multiples of 128 bytes too
                                math.nan, math.inf])
def test_bucket_cap_mb_invalid(mb):
    with pytest.raises(ValueError, match="bucket_cap_mb=.*multiple of 128"):
        bucket_cap_mb_to_bytes(mb)


def test_distributed_optimizer_applies_bucket_cap(monkeypatch):
    """``DistributedOptimizer(bucket_cap_mb=...)``'s helper: validated before the engine is
    touched, None leaves the threshold alone, 0 reaches the engine as 0 (no fusion)."""
    pytest.importorskip("tensorflow")
    from sdp.tensorflow import optimizer
    calls = []
    monkeypatch.setattr(optimizer.api, "set_fusion_threshold", calls.append)
    optimizer.apply_bucket_cap(None)
    optimizer.apply_bucket_cap(0.5)
    optimizer.apply_bucket_cap(0)
    for bad in (100 / 2 ** 20, 1e-9, -1):
        with pytest.raises(ValueError, match="multiple of 128"):
            optimizer.apply_bucket_cap(bad)
    assert calls == [524288, 0]


# ---- the engine honours the environment ---------------------------------------------------------
K, STEPS = 5, 3


@pytest.mark.parametrize("env, cap, threshold, per_list, cycle_ms", [
    ({}, None, 26214400, 1, 0.0),  # default: a list is one fused collective
    ({"SDP_FUSION_THRESHOLD": "0"}, None, 0, K, 0.0),  # no fusion: one collective per tensor
    ({"HOROVOD_FUSION_THRESHOLD": "0"}, None, 0, K, 0.0),
    ({"SDP_FUSION_THRESHOLD": "8192"}, None, 8192, 3, 0.0),  # 4000-byte tensors: 2 + 2 + 1
    ({}, 0, 0, K, 0.0),  # bucket_cap_mb=0 -> 0 bytes -> no fusion
    ({"SDP_CYCLE_TIME": "5"}, None, 26214400, 1, 5.0),
], ids=["default", "sdp0", "horovod0", "sdp8192", "bucket_cap0", "cycle5"])
def test_engine_honours_environment(monkeypatch, env, cap, threshold, per_list, cycle_ms):
    for name in ALL_NAMES:  # the workers inherit this process's environment
        monkeypatch.delenv(name, raising=False)
    # (the engine's fusion: these small tensors would take the fast lane, which fuses on its own)
    values = check_ok(run_workers(2, "workers_config:lists", [K, STEPS, cap], env={**env, "SDP_FAST_LANE": "0"},
                                  timeout=120))
    for v in values:
        assert v["ok"], v
        assert v["threshold"] == threshold and v["cycle_ms"] == cycle_ms, v
        assert v["per_list"] == [per_list] * STEPS, v


@pytest.mark.parametrize("n, env, capped", [(2, {}, True), (2, {"OMP_NUM_THREADS": "2"}, False),
                                            (2, {"OPENBLAS_NUM_THREADS": "2"}, False)])
def test_blas_threads_share_the_cores_unless_the_user_chose(n, env, capped):
    """Several ranks on a host: init() caps numpy's BLAS at cores // local size threads
    (sdp.common.blas_threads); a thread count set in the environment wins."""
    for cores, share, counts in check_ok(run_workers(n, "workers_config:blas_threads", [], env=env)):
        assert counts, "numpy's BLAS not found by threadpoolctl"
        want = share if capped else min(2, cores)  # (OpenBLAS takes at most a thread per core)
        assert counts == [want] * len(counts), (share, counts, env)


def test_blas_threads_alone_on_a_host_keep_their_default():
    from threadpoolctl import threadpool_info

    from sdp.common import blas_threads
    before = [i["num_threads"] for i in threadpool_info()]
    assert blas_threads.share_cores(1) is None
    assert [i["num_threads"] for i in threadpool_info()] == before
