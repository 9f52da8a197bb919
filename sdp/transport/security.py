"""The job secret and how sockets are authenticated with it.

A job has one secret: ``sdprun`` makes one (:func:`new_secret`) and hands it to its ranks
(environment ``SDP_SECRET`` for local ranks, ssh's standard input for remote ones, never a
command line); a job started by another launcher reads ``SDP_SECRET`` or ``SDP_SECRET_FILE``
(:func:`secret_from_env`).  A job of one rank needs none; a job of more ranks without one stops
at ``init()`` with :class:`SecretError` (:func:`require_secret`).

Every ZeroMQ socket of a job authenticates with the secret through ZeroMQ's own security
(ZMTP CURVE / PLAIN with a ZAP handler, RFC 26/27), never a home-made handshake:

* **Keys.**  Two CURVE key pairs are derived from the secret (HMAC-SHA256 of the secret with a
  label gives a 32-byte Curve25519 secret key, ``zmq.curve_public`` its public key): one for
  every server socket of the job, one for every client.  Every rank derives the same pairs, so no
  key is ever exchanged; a process without the secret knows neither.
* **Gatekeeper.**  Each ZeroMQ context that has server sockets runs a :class:`Gatekeeper`
  (pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`, the ZAP handler): it admits a CURVE
  client only if it proves it holds the job's client key, and a PLAIN client only with a
  single-use token this process issued (see below).  Everything else is refused and logged.
* **Rendezvous and model store:** always CURVE (authenticated and encrypted).  The elastic HTTP
  endpoint of ``sdprun -w`` (HTTP for KungFu's config-server protocol, so not ZeroMQ) takes
  requests signed with a key derived from the secret, each valid once (:func:`http_authorization`,
  :class:`HttpVerifier`).
* **Rank-to-rank data (the mesh), ``SDP_ENCRYPT``.**  CURVE encrypts every byte (libsodium's
  XSalsa20-Poly1305 in ZeroMQ's I/O thread).  Measured on this 2-core host (one 64 MB message,
  DEALER -> ROUTER, best of 5): TCP loopback 1.33 GB/s without CURVE, 0.45 GB/s with it; ipc
  1.76 GB/s vs 0.45 GB/s.  2-rank allreduce over ZeroMQ only (``SDP_SHM_SLAB_BYTES=0 sdprun -np 2
  python benchmarks/allreduce.py --baseline none --sizes 1K,1M,64M --no-fused-table``, 6 runs each,
  interleaved, while other jobs kept the load average at ~9 on 2 cores, so best of 6 and range):
  64 MB busbw 1.35 GB/s (0.20-1.35) authenticated only vs 0.38 GB/s (0.13-0.38) encrypted; 1 MB
  0.21 vs 0.14 GB/s in the one run with the table; 1 KB latency is dominated by the noise (best
  median 195 us vs 1062 us).  CURVE costs 3-4x on bulk data.  So by default
  (``SDP_ENCRYPT=0``) the mesh authenticates each connection with ZMTP PLAIN and a **single-use
  token**: every rank makes one random 128-bit token per peer, publishes it in its rendezvous
  entry (which travels only over CURVE, so only holders of the secret see it), and its
  gatekeeper accepts that token once, for that peer's rank name only.  A recorded handshake
  replayed later presents a spent token and is refused; a process without the secret never sees
  a token.  The payload then travels in the clear, as with Horovod/NCCL: on a network where
  others can *read or alter* packets in flight, set ``SDP_ENCRYPT=1`` (CURVE on the mesh too).
"""
import dataclasses
import functools
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from typing import Dict, Mapping, Optional

from sdp.common.errors import SdpError

SECRET_ENV = "SDP_SECRET"
SECRET_FILE_ENV = "SDP_SECRET_FILE"
SECRET_BYTES = 32
ZAP_DOMAIN = b"sdp"
TOKEN_BYTES = 16  # single-use PLAIN tokens: 128 random bits

log = logging.getLogger("sdp.security")


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


def require_secret(size: int, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The job secret for a job of ``size`` ranks: None for one rank (no socket is opened),
    else :func:`secret_from_env`.  Raises :class:`SecretError` when ``size > 1`` and there is
    none, saying how to give one."""
    secret = secret_from_env(env)
    if secret is None and size > 1:
        raise SecretError(
            f"a job of {size} ranks needs a job secret, so that only its own processes can join it: "
            f"start it with sdprun (which makes one), or give every rank the same secret in "
            f"{SECRET_ENV} or in a file named by {SECRET_FILE_ENV} (e.g. "
            f"python -c 'import secrets; print(secrets.token_hex(32))' > secret; chmod 600 secret)")
    return secret


def _derive(secret: str, label: str) -> bytes:
    return hmac.new(secret.encode(), b"sdp/" + label.encode(), hashlib.sha256).digest()


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """The job's CURVE keys, Z85-encoded (40 bytes each)."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=8)
def job_keys(secret: str) -> JobKeys:
    """The CURVE key pairs every rank of the job with ``secret`` derives (deterministic)."""
    import zmq
    from zmq.utils import z85
    if not zmq.has("curve"):
        raise SecretError("this libzmq was built without CURVE security; install pyzmq's wheels "
                          "(they bundle libzmq with libsodium)")
    ss = z85.encode(_derive(secret, "curve-server"))
    cs = z85.encode(_derive(secret, "curve-client"))
    return JobKeys(zmq.curve_public(ss), ss, zmq.curve_public(cs), cs)


HTTP_SCHEME = "SDP-HMAC-SHA256"
HTTP_WINDOW_S = 120.0  # seconds a signed HTTP request stays valid (clock skew between hosts included)


def _http_mac(secret: str, method: str, target: str, ts: str, nonce: str, body: bytes) -> str:
    msg = "\n".join([method.upper(), target, ts, nonce, hashlib.sha256(body).hexdigest()]).encode()
    return hmac.new(_derive(secret, "http-hmac"), msg, hashlib.sha256).hexdigest()


def http_authorization(secret: str, method: str, target: str, body: bytes = b"") -> str:
    """The ``Authorization`` header value of one HTTP request to a job endpoint: an HMAC-SHA256
    (key derived from the secret, which never travels) over the method, the request target
    (path and query, e.g. ``/config``), a timestamp, a random nonce and the body's SHA-256:
    ``SDP-HMAC-SHA256 ts=<unix s>,nonce=<32 hex>,sig=<64 hex>``.  Valid once, within
    ``HTTP_WINDOW_S`` seconds (see :class:`HttpVerifier`)."""
    ts, nonce = str(int(time.time())), secrets.token_hex(16)
    return f"{HTTP_SCHEME} ts={ts},nonce={nonce},sig={_http_mac(secret, method, target, ts, nonce, body)}"


class HttpVerifier:
    """Checks :func:`http_authorization` headers for one job endpoint: the signature (constant-time
    comparison), the timestamp (within ``window_s`` of this host's clock) and that the nonce was
    not seen before (nonces are kept for ``window_s``), so a captured request cannot be replayed,
    nor its body or target changed.  Thread-safe."""

    def __init__(self, secret: str, window_s: float = HTTP_WINDOW_S):
        self._secret = secret
        self._window = window_s
        self._seen: Dict[str, float] = {}
        self._lock = threading.Lock()

    @staticmethod
    def parse(header: Optional[str]) -> Optional[Dict[str, str]]:
        """The fields of a well-formed header, or None (check before reading a body)."""
        if not header or not header.startswith(HTTP_SCHEME + " ") or len(header) > 300:
            return None
        fields = dict(kv.split("=", 1) for kv in header[len(HTTP_SCHEME) + 1:].split(",") if "=" in kv)
        if set(fields) != {"ts", "nonce", "sig"} or not fields["ts"].isdigit():
            return None
        return fields

    def check(self, header: Optional[str], method: str, target: str, body: bytes = b"") -> Optional[str]:
        """None when the request is authentic and new, else why not."""
        f = self.parse(header)
        if f is None:
            return f"no {HTTP_SCHEME} authorization"
        want = _http_mac(self._secret, method, target, f["ts"], f["nonce"], body)
        if not hmac.compare_digest(f["sig"].encode(), want.encode()):
            return "wrong signature (no or wrong job secret, or the request was altered)"
        now = time.time()
        if abs(now - int(f["ts"])) > self._window:
            return f"timestamp {f['ts']} is more than {self._window:g} s from this host's clock"
        with self._lock:
            for n, t in [(n, t) for n, t in self._seen.items() if now - t > self._window]:
                del self._seen[n]
            if f["nonce"] in self._seen:
                return "replayed (nonce already used)"
            self._seen[f["nonce"]] = now
        return None


def secure_server(sock, secret: str, encrypt: bool = True) -> None:
    """Make ``sock`` (before ``bind``) a server of the job: CURVE with the job's server key, or
    PLAIN (single-use tokens) when ``encrypt`` is false.  Its context must run a
    :class:`Gatekeeper`, which decides who gets in; ``Gatekeeper.guard(sock)`` applies the slot
    policy to its connections (:mod:`sdp.transport.guard`).  Connections that have not authenticated within
    ``sdp.transport.guard.HANDSHAKE_IVL_MS`` are closed."""
    from sdp.transport.guard import HANDSHAKE_IVL_MS
    sock.zap_domain = ZAP_DOMAIN
    sock.handshake_ivl = HANDSHAKE_IVL_MS  # an unauthenticated connection holds a descriptor this long at most
    if encrypt:
        sock.curve_server = True
        sock.curve_secretkey = job_keys(secret).server_secret
    else:
        sock.plain_server = True


def secure_client(sock, secret: str, user: Optional[str] = None, token: Optional[str] = None) -> None:
    """Make ``sock`` (before ``connect``) a client of the job: CURVE with the job's client key,
    or PLAIN as ``user`` with the single-use ``token`` a server issued for it."""
    if token is not None:
        sock.plain_username = (user or "").encode()
        sock.plain_password = token.encode()
        return
    keys = job_keys(secret)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def _gatekeeper_class():
    from zmq.auth.thread import ThreadAuthenticator

    from sdp.transport.guard import ConnectionGuard, Outcomes, RefusalLog, source_name

    class _Gatekeeper(ThreadAuthenticator):
        def __init__(self, ctx, secret: str, name: str):
            super().__init__(ctx, log=logging.getLogger("sdp.security.zap"))
            self._client_key = job_keys(secret).client_public
            self._tokens: Dict[str, bytes] = {}
            self._token_lock = threading.Lock()
            self.name = name
            self.rejected = 0
            self.refusals = RefusalLog(name)
            self.outcomes = Outcomes()
            self._address = ""  # of the ZAP request being handled (one at a time, in the ZAP thread)
            self._reason = ""
            self.start()
            self.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self)

        def guard(self, sock):
            """A :class:`~sdp.transport.guard.ConnectionGuard` of server socket ``sock`` of this
            context (the slot policy of :mod:`sdp.transport.guard`)."""
            return ConnectionGuard(sock, self.refusals, self.outcomes.take)

        async def handle_zap_message(self, msg):
            self._address = source_name(msg[3].decode(errors="replace")) if len(msg) > 3 else ""
            self._reason = ""
            await super().handle_zap_message(msg)

        def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
            ok = status_code == b"200"
            self.outcomes.add(self._address, "ok" if ok else "refused")
            if not ok:
                self.rejected += 1
                self.refusals.refused(self._address, self._reason or status_text.decode(errors="replace"))
            super()._send_zap_reply(request_id, status_code, status_text, user_id)

        # CURVE: pyzmq calls callback(domain, z85 client key)
        def callback(self, domain, key) -> bool:
            if hmac.compare_digest(bytes(key), self._client_key):
                return True
            self._reason = "a foreign CURVE client key (no or wrong job secret)"
            return False

        def issue_token(self, user: str) -> str:
            token = secrets.token_hex(TOKEN_BYTES)
            with self._token_lock:
                self._tokens[user] = token.encode()
            return token

        def _authenticate_plain(self, domain, username, password):
            with self._token_lock:
                want = self._tokens.get(username)
                ok = want is not None and hmac.compare_digest(password.encode(), want)
                if ok:
                    del self._tokens[username]  # single use: a replayed handshake finds it spent
            if ok:
                return True, b"OK"
            self._reason = (f"PLAIN as {username[:32]!r}: "
                            + ("token already used or never issued" if want is None else "wrong token"))
            return False, b"bad or spent token"

    return _Gatekeeper


def Gatekeeper(ctx, secret: str, name: str = "sdp"):
    """Start the ZAP handler of ZeroMQ context ``ctx`` (one per context; stop it with ``.stop()``
    before ``ctx.term()``): admits CURVE clients holding the client key derived from ``secret``
    and PLAIN clients presenting a token from ``.issue_token(user)`` (once).  ``name`` labels its
    log lines; ``.rejected`` counts refused handshakes; ``.refusals`` logs them with the source
    address (:class:`sdp.transport.guard.RefusalLog`)."""
    return _gatekeeper_class()(ctx, secret, name)
