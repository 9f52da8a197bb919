"""The job secret and how sockets are authenticated with it.

A job has one secret: ``sdprun`` makes one (:func:`new_secret`) and hands it to its ranks
(environment ``SDP_SECRET`` for local ranks, ssh's standard input for remote ones, never a
command line); a job started by another launcher reads ``SDP_SECRET`` or ``SDP_SECRET_FILE``
(:func:`secret_from_env`).  Every ZeroMQ socket of a job authenticates with it through ZeroMQ's
own security mechanisms (see the rest of this module).
"""
import os
import secrets
from typing import Mapping, Optional

from sdp.common.errors import SdpError

SECRET_ENV = "SDP_SECRET"
SECRET_FILE_ENV = "SDP_SECRET_FILE"
SECRET_BYTES = 32


class SecretError(SdpError):
    """The job secret is missing, unreadable or malformed."""


def new_secret() -> str:
    """A new random job secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(SECRET_BYTES)


def secret_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The job secret from ``SDP_SECRET``, else from the file named by ``SDP_SECRET_FILE``
    (surrounding whitespace stripped), else None.  Raises :class:`SecretError` when the file
    cannot be read or either is empty."""
    env = os.environ if env is None else env
    value = env.get(SECRET_ENV)
    if value is None and env.get(SECRET_FILE_ENV):
        path = env[SECRET_FILE_ENV]
        try:
            with open(path, "r", encoding="utf-8") as f:
                value = f.read(4096)
        except OSError as e:
            raise SecretError(f"{SECRET_FILE_ENV}={path}: cannot read the job secret: {e}") from None
    if value is None:
        return None
    value = value.strip()
    if not value:
        raise SecretError(f"the job secret ({SECRET_ENV} or {SECRET_FILE_ENV}) is empty")
    return value
