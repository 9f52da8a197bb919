"""TensorFlow's thread pools when several ranks share a host's cores.

Each rank's TensorFlow sizes its inter-op and intra-op pools to every core of the host, and by
default an idle pool thread *spins* (polls for work, ~tens of microseconds) before it sleeps.
With one rank per host that trades a core's idle time for latency.  With ``local_size() > 1``
the spinning threads of one rank take the cores the other ranks' threads (their engine, their
op that waits in a collective) need at that moment.  Measured on a 2-core machine, 2 ranks, a
1 KB allreduce inside a ``tf.function``: 466-805 us with spinning (a slow phase at ~750-800 us in
about one run of five), 410-470 us without in most runs (the slow phase in 2 of 50); in
alternating pairs 470-493 against 427-444 us.  The call of a ``tf.function`` holding one
``numpy_function`` went from ~165 to ~125 us.

``configure`` therefore turns spinning off (TensorFlow's own
``ConfigProto.experimental.disable_thread_spinning``) when this host runs more than one rank.
``SDP_TF_THREAD_SPINNING=1`` keeps TensorFlow's default.  It only takes effect before TensorFlow
creates its runtime (its first op or ``tf.function`` call): ``init()`` is usually called first,
as Horovod's and SMDDP's guides do; after that it changes nothing (logged at debug level).
"""
import logging
import os

log = logging.getLogger("sdp.tensorflow")


SPINNING_ENV = "SDP_TF_THREAD_SPINNING"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _spinning_requested() -> bool:
    """``SDP_TF_THREAD_SPINNING`` as a bool (unset: False); ``ValueError`` naming it otherwise."""
    value = os.environ.get(SPINNING_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"environment variable {SPINNING_ENV}={os.environ[SPINNING_ENV]!r}: expected 0 or 1")
    return value in _TRUE


def configure(local_size: int) -> bool:
    """Turn off TensorFlow's thread spinning when ``local_size`` (ranks on this host) > 1 and
    ``SDP_TF_THREAD_SPINNING`` is not ``1``; returns True if the setting was applied.  Raises
    ``ValueError`` for a value of ``SDP_TF_THREAD_SPINNING`` other than 0/1 (true/false, yes/no,
    on/off).

    Uses the eager context's ``ConfigProto`` (what ``tf.config.threading`` also sets) before
    TensorFlow initializes its runtime; returns False, changing nothing, once it has."""
    if local_size <= 1 or _spinning_requested():
        return False
    try:
        from tensorflow.core.protobuf import config_pb2
        from tensorflow.python.eager import context
        ctx = context.context()
        if ctx._initialized:  # the runtime (and its pools) exist already
            log.debug("TensorFlow already initialized: its threads keep spinning")
            return False
        config = config_pb2.ConfigProto()
        if ctx._config is not None:
            config.CopyFrom(ctx._config)
        config.experimental.disable_thread_spinning = True
        ctx._config = config
        return True
    except (ImportError, AttributeError) as e:  # pragma: no cover - TF internals moved
        log.debug("cannot configure TensorFlow's thread spinning: %r", e)
        return False
