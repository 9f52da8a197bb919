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
| SDP_CACHE_CAPACITY        | 1024         | response-cache entries (tensor signatures agreed once, then |
|                           |              | sent as an id); 0: no response cache (every request in full)|
| SDP_SEGMENT_BYTES         | 1048576 (B)  | size of one pipelined frame on the wire                    |
| SDP_SHM_SLAB_BYTES        | 33554432 (B) | same-host shared-memory slab (0: no shared memory)         |
| SDP_SHM_POOL_BYTES        | 134217728 (B)| same-host shared-memory pool that allreduce results are    |
|                           |              | written into directly (0: copy results out of the slabs)   |
| SDP_HIERARCHICAL          | auto         | 1: hierarchical allreduce/allgather across hosts (shared   |
|                           |              | memory per host, ZeroMQ between hosts); 0: flat; auto: on  |
|                           |              | when ranks span several hosts and a host has several ranks |
|                           |              | (op=Adasum: hierarchical with 1 only, sdp.engine.adasum)   |
| SDP_TIMELINE              | unset        | path of a Chrome-trace JSON timeline                       |
| SDP_LOG_LEVEL             | WARNING      | level of the ``sdp`` logger                                |
| SDP_ENCRYPT               | 0            | 1: encrypt rank-to-rank data (CURVE); 0: authenticate each |
|                           |              | connection only (see sdp.transport.security)               |
| SDP_GPU_IPC               | auto         | device arrays: auto/1 reduce through CUDA IPC when every   |
|                           |              | rank is on one host; 0: stage through host memory (see     |
|                           |              | sdp.engine.device_path)                                    |
| SDP_FAST_LANE             | 1            | 1: small allreduces of ranks all on one host skip the      |
|                           |              | coordinator (see sdp.engine.lane); across hosts the        |
|                           |              | synchronous ones go through the host leaders' link (see    |
|                           |              | sdp.engine.hostlink), the others ride the negotiation (see |
|                           |              | sdp.engine.inline); 0: every collective goes through the   |
|                           |              | engine thread and rank 0                                   |
| SDP_DEVICE_BACKEND        | cuda         | cuda (PyCUDA) or numpy (host memory standing in for a      |
|                           |              | device: runs the device path without a GPU, for tests)     |

Horovod spellings (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``, ``HOROVOD_TIMELINE``,
``HOROVOD_START_TIMEOUT``, ``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``,
``HOROVOD_HIERARCHICAL_ALLREDUCE``, ``HOROVOD_CACHE_CAPACITY``) are read as fallbacks; an empty value counts as unset.  A value
that is not allowed (does not parse; a negative or NaN byte count or time; a flag other than 0/1;
an unknown ``SDP_LOG_LEVEL``) is one line naming the variable, the value and what is allowed
(``check_env``): ``sdprun`` prints it and starts no rank; a rank started otherwise raises it
as one ``ValueError`` from ``init()``.
"""
import dataclasses
import math
import os
from typing import Callable, List, Mapping, Optional

DEFAULT_FUSION_THRESHOLD = 25 * 1024 * 1024


def _whole_bytes(value: str) -> int:
    out = int(value)
    if out < 0:
        raise ValueError(value)
    return out


def _seconds(value: str) -> float:
    out = float(value)
    if not out >= 0:  # negative or NaN
        raise ValueError(value)
    return out


def _level(value: str):
    """A logging level: a name (any case) or a whole number."""
    import logging
    value = value.strip()
    if value.isdigit():
        return int(value)
    if not isinstance(logging.getLevelName(value.upper()), int):
        raise ValueError(value)
    return value.upper()


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting read from the environment: the variables that give it (first set wins), how
    its value is parsed (``ValueError`` when it is not allowed) and what is allowed, in words."""
    field: Optional[str]  # the Config field, or None when another module reads it
    names: tuple
    parse: Callable[[str], object]
    allowed: str


_BYTES = "a whole number of bytes >= 0"
_SECONDS = "a number of seconds >= 0"
_MS = "a number of milliseconds >= 0"
_FLAG = "0 or 1"
#: Every SDP_*/HOROVOD_* setting of the engine: what ``Config.from_env`` and ``sdprun`` check.
SETTINGS = (
    Setting("fusion_threshold", ("SDP_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"), _whole_bytes, _BYTES),
    Setting("cycle_time_ms", ("SDP_CYCLE_TIME", "HOROVOD_CYCLE_TIME"), _seconds, _MS),
    Setting("timeout_s", ("SDP_TIMEOUT",), _seconds, _SECONDS),
    Setting("start_timeout_s", ("SDP_START_TIMEOUT", "HOROVOD_START_TIMEOUT"), _seconds, _SECONDS),
    Setting("stall_check_s", ("SDP_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"), _seconds, _SECONDS),
    Setting("stall_shutdown_s", ("SDP_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), _seconds,
            _SECONDS),
    Setting("peer_timeout_s", ("SDP_PEER_TIMEOUT",), _seconds, _SECONDS + " (0: never)"),
    Setting("cache_capacity", ("SDP_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"), _whole_bytes,
            "a whole number of entries >= 0 (0: no response cache)"),
    Setting("segment_bytes", ("SDP_SEGMENT_BYTES",), _whole_bytes, _BYTES),
    Setting("shm_slab_bytes", ("SDP_SHM_SLAB_BYTES",), _whole_bytes, _BYTES),
    Setting("shm_pool_bytes", ("SDP_SHM_POOL_BYTES",), _whole_bytes, _BYTES),
    Setting("hierarchical", ("SDP_HIERARCHICAL", "HOROVOD_HIERARCHICAL_ALLREDUCE"), lambda v: flag(v), _FLAG),
    Setting("timeline", ("SDP_TIMELINE", "HOROVOD_TIMELINE"), str, "a file path"),
    Setting("encrypt", ("SDP_ENCRYPT",), lambda v: flag(v), _FLAG),
    Setting("gpu_ipc", ("SDP_GPU_IPC",), lambda v: flag(v), _FLAG),
    Setting("fast_lane", ("SDP_FAST_LANE",), lambda v: flag(v), _FLAG),
    Setting(None, ("SDP_LOG_LEVEL",), _level, "DEBUG, INFO, WARNING, ERROR or CRITICAL (any case), or a number"),
    Setting(None, ("SDP_DEVICE_BACKEND",), lambda v: _choice(v, ("cuda", "numpy")), "cuda or numpy"),
)


def _choice(value: str, allowed: tuple) -> str:
    if value.strip().lower() not in allowed:
        raise ValueError(value)
    return value.strip().lower()


def setting_error(name: str, value: str, allowed: str) -> str:
    """The one-line message for an environment value that is not allowed."""
    return f"{name}={value!r} is not allowed: {allowed}"


def _read(env, setting: Setting):
    """``(name, parsed value)`` of the first variable of ``setting`` set in ``env`` (empty
    counts as unset), or None; raises ``ValueError`` with ``setting_error``'s text."""
    for name in setting.names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return name, setting.parse(value)
            except (ValueError, OverflowError):
                raise ValueError(setting_error(name, value, setting.allowed)) from None
    return None


def check_env(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """One message per setting of ``SETTINGS`` whose value in ``env`` (default
    ``os.environ``) is not allowed, e.g. ``SDP_FUSION_THRESHOLD='-5' is not allowed: a whole
    number of bytes >= 0``; empty when all are fine.  ``sdprun`` prints these before it starts
    a rank; ``Config.from_env`` raises them as one ``ValueError``."""
    env = os.environ if env is None else env
    problems = []
    for setting in SETTINGS:
        try:
            _read(env, setting)
        except ValueError as e:
            problems.append(str(e))
    return problems


def log_level_from_env(env: Optional[Mapping[str, str]] = None):
    """``SDP_LOG_LEVEL`` as a level name (upper-cased) or number, or None when unset;
    ``ValueError`` (``setting_error``) if unknown."""
    got = _read(os.environ if env is None else env, next(s for s in SETTINGS if s.names == ("SDP_LOG_LEVEL",)))
    return None if got is None else got[1]


@dataclasses.dataclass
class Config:
    """The engine's settings, one field per ``SDP_*`` variable of the table above (seconds in
    ``*_s`` fields, bytes in ``*_bytes`` and ``fusion_threshold``); ``Config.from_env()`` reads
    them.  ``sdp.init(config)`` takes one instead of the environment."""

    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD  # bytes; 0 disables fusion
    cycle_time_ms: float = 0.0
    timeout_s: float = 300.0
    start_timeout_s: float = 60.0
    stall_check_s: float = 60.0
    stall_shutdown_s: float = 0.0
    peer_timeout_s: float = 30.0  # SDP_PEER_TIMEOUT
    cache_capacity: int = 1024  # SDP_CACHE_CAPACITY / HOROVOD_CACHE_CAPACITY: response-cache entries
    segment_bytes: int = 1 << 20
    shm_slab_bytes: int = 32 << 20
    shm_pool_bytes: int = 128 << 20
    hierarchical: Optional[bool] = None  # None: automatic
    timeline: Optional[str] = None
    encrypt: bool = False  # SDP_ENCRYPT
    gpu_ipc: Optional[bool] = None  # SDP_GPU_IPC: None automatic (one host), False host-staged
    fast_lane: bool = True  # SDP_FAST_LANE: small allreduces skip the coordinator (one host, or synchronous across
    # hosts: the leaders' link) or ride it (asynchronous across hosts)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        """The settings in ``env`` (default ``os.environ``), defaults for the unset ones.
        Raises one ``ValueError`` naming every variable whose value is not allowed, its value
        and what is allowed (``check_env``)."""
        env = os.environ if env is None else env
        problems = check_env(env)
        if problems:
            raise ValueError("; ".join(problems))
        values = {}
        for setting in SETTINGS:
            got = _read(env, setting) if setting.field else None
            if got is not None:
                values[setting.field] = got[1]
        return cls(**values)


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
