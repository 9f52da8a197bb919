"""Runtime settings read from the environment, with their defaults and units.

| variable                  | default      | meaning                                                   |
|---------------------------|--------------|-----------------------------------------------------------|
| SDP_FUSION_THRESHOLD      | 26214400 (B) | fusion buffer size in bytes (25 MB, SMDDP's bucket_cap_mb) |
| SDP_CYCLE_TIME            | 0 (ms)       | least time between two negotiation rounds of a rank; tensors |
|                           |              | submitted together (a gradient list) always go together    |
| SDP_TIMEOUT               | 300 (s)      | deadline of any single receive inside a collective         |
| SDP_START_TIMEOUT         | 60 (s)       | deadline for all ranks to meet at rendezvous               |
| SDP_STALL_CHECK_TIME      | 60 (s)       | warn when a tensor waits this long for other ranks (0: off)|
| SDP_STALL_SHUTDOWN_TIME   | 0 (s, off)   | raise StallError on every rank once a tensor waited this   |
|                           |              | long for other ranks (names the tensors and missing ranks) |
| SDP_PEER_TIMEOUT          | 30 (s)       | a peer process that is alive but answers nothing for this  |
|                           |              | long (stopped, hung) is lost: PeerLostError (0: never).    |
|                           |              | Death (~1 s) and a cut link (~7 s) are seen sooner (see    |
|                           |              | sdp.transport.zmq_mesh)                                    |
| SDP_SEGMENT_BYTES         | 1048576 (B)  | size of one pipelined frame on the wire                    |
| SDP_SHM_SLAB_BYTES        | 33554432 (B) | same-host shared-memory slab (0: no shared memory)         |
| SDP_SHM_POOL_BYTES        | 134217728 (B)| same-host shared-memory pool that allreduce results are    |
|                           |              | written into directly (0: copy results out of the slabs)   |
| SDP_HIERARCHICAL          | auto         | 1: hierarchical allreduce/allgather across hosts (shared   |
|                           |              | memory per host, ZeroMQ between hosts); 0: flat; auto: on  |
|                           |              | when ranks span several hosts and a host has several ranks |
| SDP_TIMELINE              | unset        | path of a Chrome-trace JSON timeline                       |
| SDP_LOG_LEVEL             | WARNING      | level of the ``sdp`` logger                                |
| SDP_ENCRYPT               | 0            | 1: encrypt rank-to-rank data (CURVE); 0: authenticate each |
|                           |              | connection only (see sdp.transport.security)               |
| SDP_GPU_IPC               | auto         | device arrays: auto/1 reduce through CUDA IPC when every   |
|                           |              | rank is on one host; 0: stage through host memory (see     |
|                           |              | sdp.engine.device_path)                                    |
| SDP_DEVICE_BACKEND        | cuda         | cuda (PyCUDA) or numpy (host memory standing in for a      |
|                           |              | device: runs the device path without a GPU, for tests)     |

Horovod spellings (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``, ``HOROVOD_TIMELINE``,
``HOROVOD_START_TIMEOUT``, ``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``,
``HOROVOD_HIERARCHICAL_ALLREDUCE``) are read as fallbacks; an empty value counts as unset.  A value
that does not parse, or a negative (or NaN) byte count or time, raises ``ValueError`` naming the
variable and its value.
"""
import dataclasses
import math
import os
from typing import Mapping, Optional

DEFAULT_FUSION_THRESHOLD = 25 * 1024 * 1024


def _get(env, names, default, cast):
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                out = cast(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not a valid {cast.__name__}") from None
            if cast is not str and not out >= 0:  # every number here is a byte count or a time
                raise ValueError(f"environment variable {name}={value!r} must be >= 0")
            return out
    return default


@dataclasses.dataclass
class Config:
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD  # bytes; 0 disables fusion
    cycle_time_ms: float = 0.0
    timeout_s: float = 300.0
    start_timeout_s: float = 60.0
    stall_check_s: float = 60.0
    stall_shutdown_s: float = 0.0
    peer_timeout_s: float = 30.0  # SDP_PEER_TIMEOUT
    segment_bytes: int = 1 << 20
    shm_slab_bytes: int = 32 << 20
    shm_pool_bytes: int = 128 << 20
    hierarchical: Optional[bool] = None  # None: automatic
    timeline: Optional[str] = None
    encrypt: bool = False  # SDP_ENCRYPT
    gpu_ipc: Optional[bool] = None  # SDP_GPU_IPC: None automatic (one host), False host-staged

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        env = os.environ if env is None else env
        return cls(
            fusion_threshold=_get(env, ["SDP_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"],
                                  DEFAULT_FUSION_THRESHOLD, int),
            cycle_time_ms=_get(env, ["SDP_CYCLE_TIME", "HOROVOD_CYCLE_TIME"], 0.0, float),
            timeout_s=_get(env, ["SDP_TIMEOUT"], 300.0, float),
            start_timeout_s=_get(env, ["SDP_START_TIMEOUT", "HOROVOD_START_TIMEOUT"], 60.0, float),
            stall_check_s=_get(env, ["SDP_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"], 60.0, float),
            stall_shutdown_s=_get(env, ["SDP_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"],
                                  0.0, float),
            peer_timeout_s=_get(env, ["SDP_PEER_TIMEOUT"], 30.0, float),
            segment_bytes=_get(env, ["SDP_SEGMENT_BYTES"], 1 << 20, int),
            shm_slab_bytes=_get(env, ["SDP_SHM_SLAB_BYTES"], 32 << 20, int),
            shm_pool_bytes=_get(env, ["SDP_SHM_POOL_BYTES"], 128 << 20, int),
            hierarchical=_get(env, ["SDP_HIERARCHICAL", "HOROVOD_HIERARCHICAL_ALLREDUCE"], None, flag),
            timeline=_get(env, ["SDP_TIMELINE", "HOROVOD_TIMELINE"], None, str),
            encrypt=_get(env, ["SDP_ENCRYPT"], False, flag),
            gpu_ipc=_get(env, ["SDP_GPU_IPC"], None, flag),
        )


def flag(value: str) -> bool:
    """``"1"`` -> True, ``"0"`` -> False; anything else raises ``ValueError``."""
    if value.strip() not in ("0", "1"):
        raise ValueError(value)
    return value.strip() == "1"


def bucket_cap_mb_to_bytes(bucket_cap_mb) -> int:
    """Convert SMDDP's ``bucket_cap_mb`` to bytes.

    Raises ``ValueError`` unless ``bucket_cap_mb * 1024 * 1024`` is a non-negative multiple of 128,
    as SMDDP documents (so NaN and infinity raise too).  0 gives 0 bytes: no fusion.
    """
    nbytes = bucket_cap_mb * 1024 * 1024
    if not 0 <= nbytes < math.inf or int(nbytes) != nbytes or int(nbytes) % 128:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb!r} gives {nbytes} bytes; bucket_cap_mb * 1024 * 1024 must be "
            "a non-negative whole multiple of 128")
    return int(nbytes)


def cluster_size_of(cfg) -> int:
    """The cluster size an elastic configuration describes (the JSON of ``sdprun -w``'s config
    server): ``{"size": N}`` or KungFu's ``{"Workers": [...]}`` (its length).
    Raises ``ValueError`` for anything else."""
    if isinstance(cfg, dict):
        if isinstance(cfg.get("size"), int):
            return cfg["size"]
        for key in ("Workers", "workers"):
            if isinstance(cfg.get(key), list):
                return len(cfg[key])
    raise ValueError(f"config has neither 'size' nor a 'Workers' list: {str(cfg)[:200]}")
