"""The environment of ``sdprun``'s workers: what every worker of a job shares (:func:`job_env`)
and each rank's own ``SDP_*`` variables on top (:func:`worker_envs`); ``-x`` exports.

Every way of launching (static ``-H`` jobs, KungFu's ``-w``, Horovod Elastic's driver,
``horovod.run``) builds its workers' environments here.
"""
import os
from typing import Dict, List, Optional

from sdp.common import compat_names
from sdp.launcher import hosts as hostlib
from sdp.transport import security


def parse_exports(items: List[str], env=None) -> Dict[str, str]:
    """``-x NAME=VALUE`` / ``-x NAME`` (value from ``env``, default ``os.environ``) -> a dict.
    Raises ``ValueError`` for a bad name or a ``NAME`` that is not set."""
    env = os.environ if env is None else env
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name.isidentifier():
            raise ValueError(f"-x {item!r}: {name!r} is not a variable name")
        if not eq:
            if name not in env:
                raise ValueError(f"-x {name}: {name} is not set in sdprun's environment (give -x {name}=VALUE)")
            value = env[name]
        out[name] = value
    return out



# glibc's memcpy switches to non-temporal (cache-bypassing) stores above this many bytes.  Its own
# default is 3/4 of the L3 cache per thread (99 MB on a 260 MB-L3 host), so the fusion-buffer
# packs and shared-memory pushes (256 KB - 512 KB copies into memory another core reads next)
# would otherwise read every destination line first and evict the caller's cache on the way.
# Measured with 2 ranks here: 64 MB allreduce busbw 3.0 -> 4.2 GB/s, a fused 25 MB gradient list
# 7.1-8.0 -> 6.1-6.9 ms (benchmarks/README.md).
NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_BYTES = 128 * 1024
STREAMING_COPIES = f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_BYTES}"  # the GLIBC_TUNABLES entry sdprun adds


def with_streaming_copies(env: dict) -> dict:
    """``env`` with ``GLIBC_TUNABLES`` setting glibc's non-temporal memcpy threshold to
    ``NON_TEMPORAL_BYTES`` (128 KB), unless the user's ``GLIBC_TUNABLES`` already sets it.
    Other tunables are kept.  (glibc reads it at process start, so only a launcher can set it;
    an unknown tunable, e.g. on musl or an old glibc, is ignored.)"""
    tunables = env.get("GLIBC_TUNABLES", "")
    if NON_TEMPORAL_TUNABLE + "=" in tunables:
        return env
    return dict(env, GLIBC_TUNABLES=f"{tunables}:{STREAMING_COPIES}" if tunables else STREAMING_COPIES)


def worker_envs(ranks: List[hostlib.RankInfo], rendezvous_addr: str, job_id: str, args,
                base_env=None, secret: Optional[str] = None) -> List[dict]:
    """The full environment of each worker: :func:`job_env` plus the ``SDP_*`` variables of
    its rank."""
    base = job_env(rendezvous_addr, job_id, args, base_env, secret)
    envs = []
    for info in ranks:
        env = dict(base)
        env.update(info.env())
        envs.append(env)
    return envs


def job_env(rendezvous_addr: str, job_id: str, args, base_env=None, secret: Optional[str] = None) -> dict:
    """The environment every worker of the job shares: ``base_env`` (default ``os.environ``),
    ``-x`` variables, ``SDP_RENDEZVOUS_ADDR``, ``SDP_JOB_ID``, ``SDP_START_TIMEOUT``, ``SDP_SECRET``
    (when ``secret``), ``SDP_IFACE`` / ``SDP_COMPAT`` when asked; no rank variables."""
    base = with_streaming_copies(dict(os.environ if base_env is None else base_env))
    base.update(parse_exports(getattr(args, "export", []) or [], base))
    if secret:
        base[security.SECRET_ENV] = secret
        base.pop(security.SECRET_FILE_ENV, None)
    base.update({
        "SDP_RENDEZVOUS_ADDR": rendezvous_addr,
        "SDP_JOB_ID": job_id,
        "SDP_START_TIMEOUT": f"{args.start_timeout:g}",
        "PYTHONUNBUFFERED": "1",
    })
    if args.nic:
        base["SDP_IFACE"] = args.nic
    if args.compat:
        base[compat_names.COMPAT_ENV] = args.compat
        base["PYTHONPATH"] = os.pathsep.join(p for p in (compat_names.SHIM_DIR, base.get("PYTHONPATH")) if p)
    return base
