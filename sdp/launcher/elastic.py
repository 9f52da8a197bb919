"""Elastic (watch) mode of ``sdprun -w``: a config server and the controller that grows/shrinks jobs.

``sdprun -w`` serves a small HTTP endpoint (``--builtin-config-port PORT``, default: a free port)
on 127.0.0.1 and tells every worker where it is:

* ``SDP_ELASTIC_URL=http://127.0.0.1:PORT`` — the control endpoint (``POST /resize``);
* ``SDP_CONFIG_SERVER`` — where workers read the desired cluster: ``--config-server URL`` if given,
  else the built-in ``http://127.0.0.1:PORT/config``;
* ``SDP_ELASTIC_EPOCH`` — the cluster epoch the worker starts in (0 for the first workers).

Endpoints (JSON bodies and answers):

=====================  ===============================================================================
``GET /config``        the desired cluster: ``{"version": v, "size": n, "workers": [{"rank", "host"}],
                       "Runners": [{"Host", "Slots"}], "Workers": [{"Host", "Rank"}]}`` (KungFu's
                       document: its ``Runners`` and ``Workers`` lists); 404 after ``DELETE``
                       until written again.
``PUT /config``        replace the desired cluster: ``{"size": n}`` or KungFu's ``{"Workers": [...]}``
                       (its length is the size); bumps ``version``.  Workers pick it up at their next
                       ``resize()`` (KungFu's ``resize_cluster_from_url``).
``POST /config``       with a body: as ``PUT``; without one (KungFu's reset): back to the initial
                       cluster (``-np``), bumps ``version``.
``DELETE /config``     clear it (KungFu's clear): ``GET`` answers 404 until the next ``PUT``/``POST``;
                       ``resize()`` without a size then fails with the 404.
``POST /resize``       commit a new epoch (sent by the workers' rank 0 during ``resize``):
                       ``{"size": n, "epoch": e}`` -> ``{"epoch": e+1, "size": n, "rendezvous":
                       "tcp://...", "ranks": [{SDP_* of rank r}, ...]}``; 409 if ``e`` is not the current
                       epoch, 400 if ``n`` is not in [1, slots].
``GET /status``        ``{"epoch", "size", "capacity", "desired"}`` (Horovod Elastic: ``{"epoch", "size",
                       "members", "hosts_version", "resets"}``)
``POST /join``         Horovod Elastic only (``--host-discovery-script``): a worker leaving epoch ``e``
                       asks for the next one, ``{"worker": id, "epoch": e}``; held up to 5 s, answered
                       ``{"epoch", "rendezvous", "env"}``, ``{"wait": true}`` or ``{"stop": reason}``
                       (see :class:`HorovodElasticDriver`, :func:`sdp.elastic.reset`).
=====================  ===============================================================================

Horovod Elastic (``sdprun -np N --min-np A --max-np B --host-discovery-script S``) runs on the same
endpoint and per-epoch rendezvous servers: :class:`HorovodElasticDriver` decides the members of
each epoch itself (survivors of a failure, plus workers it starts on new slots) instead of taking
resize commits from the workers.

A commit starts a rendezvous server of the new size, starts worker processes for the new ranks
(``size .. n-1``, same command, the ``SDP_*`` variables of the new epoch), and makes ``n`` the
desired size.  Workers whose rank is ``>= n`` detach and exit on their own (see
:mod:`sdp_kungfu_bridge._cluster` for the worker side).  The job ends when every worker has exited;
a worker exiting non-zero stops the job as usual.

Security: the endpoint listens on one address (``host``, default 127.0.0.1; never
``*``/``0.0.0.0``), and every request must be signed with the job secret
(``Authorization: SDP-HMAC-SHA256 ts=..,nonce=..,sig=..``, an HMAC over method, target, time, nonce
and body; :func:`sdp.transport.security.http_authorization`, which workers compute from their
``SDP_SECRET``): a request without a well-formed header gets 401 before its body is read; one with
a wrong signature, an old timestamp (more than 120 s off) or a nonce already used (a replay) gets
401 too.  Bodies are at most ``MAX_BODY_BYTES`` (400 above).  The secret never travels; the bodies
(cluster sizes, rendezvous address, rank environments without the secret) are not encrypted.

Resources: at most ``MAX_CONNECTIONS`` (128) connections not yet signed are served at once, one
thread each; a newcomer is always let in, and the oldest connection that has sent nothing is
dropped for it (the slot policy of :mod:`sdp.transport.guard`: idle strangers displace only each
other, never a worker's request, which is signed and leaves its slot at once); a request must
arrive whole, head and body, within ``READ_TIMEOUT_S`` (5 s) of its connection, however slowly it
trickles; the listen backlog is 128.  Refusals and dropped
connections (unsigned, over the cap, timed out, reset while answered) are logged with the source
address, the first at once and the rest as one line per address per 10 s
(:class:`sdp.transport.guard.RefusalLog`), never as a traceback.  Measured: 300 connections
trickling partial requests, then reset, held 128 threads (was one per connection: 294 for 300,
and a ``BrokenPipeError`` traceback per reset one), and one log line (``tests/test_hostile.py``).
"""
import http.server
import io
import json
import logging
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import Callable, List, Optional

from sdp.common.config import cluster_size_of
from sdp.launcher import hosts as hostlib
from sdp.transport import security

log = logging.getLogger("sdp.launcher")

#: Slots of this machine in watch mode when no ``-H``/``--hostfile`` gives them.
DEFAULT_ELASTIC_SLOTS = 64
#: Largest request body the endpoint reads (bytes).
MAX_BODY_BYTES = 1 << 20
#: Connections the endpoint serves at once (one thread each); more are closed at once, logged.
MAX_CONNECTIONS = 128
#: Seconds a client has to send its whole request, head and body (then it is dropped, logged).
READ_TIMEOUT_S = 5.0


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes for at most ``READ_TIMEOUT_S`` in all: each read waits only for what is
    left of that time, so a request trickled a byte at a time cannot hold its thread longer."""

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not complete within {READ_TIMEOUT_S:g} s")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(b)
        finally:
            self._sock.settimeout(READ_TIMEOUT_S)  # for writing the answer


class _BoundedHTTPServer(http.server.ThreadingHTTPServer):
    """``ThreadingHTTPServer`` under the slot policy of :mod:`sdp.transport.guard`: at most
    ``MAX_CONNECTIONS`` connections (threads) not yet signed at once, a newcomer always let in
    and the oldest idle one dropped for it; a connection whose request is signed leaves its slot
    (the workers never compete with strangers for them); a read deadline per request
    (``READ_TIMEOUT_S``); every refused or failed connection logged with its source address, once
    per address per interval (:class:`sdp.transport.guard.RefusalLog`), never as a traceback."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 made connections beyond it wait for SYN retries)

    def __init__(self, address, handler):
        from sdp.transport.guard import RefusalLog, Slots
        super().__init__(address, handler)
        self.slots = Slots(MAX_CONNECTIONS)
        self.refusals = RefusalLog("elastic endpoint", log)

    def process_request(self, request, client_address):
        from sdp.transport.guard import received_bytes
        for victim, src in self.slots.admit(request, client_address[0], lambda s: received_bytes(s) > 0):
            try:
                victim.shutdown(socket.SHUT_RDWR)  # (its thread reads the end and finishes)
            except OSError:
                pass
            self.refusals.refused(src, f"dropped for a newer connection: {MAX_CONNECTIONS} unsigned ones were "
                                       f"already open (the oldest idle one goes)")
        try:
            super().process_request(request, client_address)  # a thread for it
        except BaseException:
            self.slots.done(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.done(request)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        self.refusals.refused(client_address[0], f"dropped: {type(exc).__name__}: {exc}"[:200])

    def service_actions(self):
        self.refusals.flush()


class ConflictError(Exception):
    """A commit for an epoch that is no longer current."""


class ElasticController:
    """The elastic state of one ``sdprun -w`` job and its HTTP endpoint.

    ``make_envs(rank_infos, rendezvous_addr, epoch)`` returns the full environment of every rank
    of an epoch; ``group`` is the :class:`~sdp.launcher.procs.WorkerGroup` new workers join.
    ``host``: the address the endpoint (and each epoch's rendezvous) binds to; ``*``/``0.0.0.0``
    raise ``ValueError``.  ``secret``: the job secret (default ``SDP_SECRET``/``SDP_SECRET_FILE``;
    raises :class:`~sdp.transport.security.SecretError` without one).
    """

    #: how workers move the job to a new epoch: ``POST /resize`` (KungFu) or ``POST /join`` (Horovod)
    commit_path = "/resize"

    def __init__(self, hosts: List[hostlib.HostSlots], group, make_envs: Callable, initial_size: int,
                 start_timeout: float, port: int = 0, config_server: Optional[str] = None,
                 http_timeout: float = 10.0, host: str = "127.0.0.1", secret: Optional[str] = None):
        if host in ("*", "0.0.0.0", "::", "[::]", ""):
            raise ValueError(f"config server host {host!r} would listen on every interface; give one address")
        self.secret = secret or security.require_secret(2)
        self.host = host
        self.hosts = hosts
        self.group = group
        self.make_envs = make_envs
        self.capacity = hostlib.total_slots(hosts)
        self.start_timeout = start_timeout
        self.http_timeout = http_timeout
        self.epoch = 0
        self.size = initial_size
        self.version = 0
        self.desired = initial_size
        self.initial_size = initial_size
        self.cleared = False  # DELETE /config: no document until written again
        self._servers = {}  # epoch -> RendezvousServer started by this controller
        self._last_commit = None
        self._lock = threading.Lock()
        controller = self

        class Handler(_Handler):
            ctl = controller

        self._httpd = _BoundedHTTPServer((host, port), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self.verifier = security.HttpVerifier(self.secret)
        self.external_config = None
        if config_server and not self._is_own(config_server):
            self.external_config = config_server
        self.config_url = self.external_config or f"{self.url}/config"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="sdprun-config-server",
                                        daemon=True)

    def _is_own(self, url: str) -> bool:
        u = urllib.parse.urlparse(url)
        return u.port == self.port and (u.hostname or "") in hostlib.local_names() | {"127.0.0.1", "localhost"}

    def start(self) -> "ElasticController":
        self._thread.start()
        log.debug("elastic mode: control endpoint %s, config server %s", self.url, self.config_url)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            for srv in self._servers.values():
                srv.stop()
            self._servers.clear()

    def worker_env(self, epoch: int = 0) -> dict:
        """The elastic variables every worker of ``epoch`` gets."""
        return {"SDP_ELASTIC_URL": self.url, "SDP_CONFIG_SERVER": self.config_url,
                "SDP_ELASTIC_EPOCH": str(epoch)}

    # -- desired configuration -------------------------------------------------------------
    def get_config(self) -> Optional[dict]:
        """The desired cluster (sdp's fields and KungFu's ``Runners``/``Workers``); ``None`` after
        :meth:`clear_config` until the next write."""
        with self._lock:
            if self.cleared:
                return None
            infos = hostlib.assign_ranks(self.hosts, self.desired) if self.desired <= self.capacity else []
            return {"version": self.version, "size": self.desired,
                    "workers": [{"rank": i.rank, "host": i.hostname} for i in infos],
                    "Runners": [{"Host": h.host, "Slots": h.slots} for h in self.hosts],
                    "Workers": [{"Host": i.hostname, "Rank": i.rank} for i in infos]}

    def put_config(self, body) -> dict:
        """Replace the desired cluster (a write always bumps ``version``).  ``ValueError`` for a
        body without a size or a size outside [1, slots]."""
        size = cluster_size_of(body)
        if not 1 <= size <= self.capacity:
            raise ValueError(f"size {size} is outside [1, {self.capacity}] (the slots of the hosts)")
        with self._lock:
            self.version += 1
            self.desired = size
            self.cleared = False
        log.info("config server: desired cluster size %d (version %d)", size, self.version)
        return self.get_config()

    def reset_config(self) -> dict:
        """KungFu's reset: the initial cluster (``-np``) again."""
        return self.put_config({"size": self.initial_size})

    def clear_config(self) -> dict:
        """KungFu's clear: no document until the next write."""
        with self._lock:
            self.cleared = True
            self.version += 1
        log.info("config server: cleared (version %d)", self.version)
        return {"version": self.version}

    def status(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch, "size": self.size, "capacity": self.capacity,
                    "desired": self.desired, "version": self.version}

    # -- commit ----------------------------------------------------------------------------
    def commit(self, body) -> dict:
        try:
            size, epoch = int(body["size"]), int(body["epoch"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("expected {\"size\": N, \"epoch\": E}") from None
        from sdp.transport.rendezvous import RendezvousServer
        with self._lock:
            last = self._last_commit
            if last is not None and epoch == last["epoch"] - 1 and size == last["size"]:
                return last  # a retried request
            if epoch != self.epoch:
                raise ConflictError(f"epoch {epoch} is not the current epoch {self.epoch}")
            if not 1 <= size <= self.capacity:
                raise ValueError(f"cannot resize to {size} workers: the hosts have {self.capacity} slots "
                                 "(give more with -H host:slots)")
            infos = hostlib.assign_ranks(self.hosts, size)
            new_epoch = epoch + 1
            server = RendezvousServer(size=size, host=self.host, port=0,
                                      timeout_s=self.start_timeout, secret=self.secret).start()
            envs = self.make_envs(infos, server.address, new_epoch)
            try:
                for r in range(self.size, size):
                    self.group.add(r, envs[r])
            except BaseException:
                server.stop()
                raise
            for old in [e for e in self._servers if e < new_epoch]:
                self._servers.pop(old).stop()  # every rank of those epochs met long ago
            self._servers[new_epoch] = server
            log.info("resize: epoch %d -> %d, %d -> %d workers%s", epoch, new_epoch, self.size, size,
                     f" (started ranks {self.size}..{size - 1})" if size > self.size else "")
            self.epoch, self.size = new_epoch, size
            if self.desired != size:
                self.desired = size
                self.version += 1
            rec = {"epoch": new_epoch, "size": size, "rendezvous": server.address,
                   "ranks": [i.env() for i in infos]}
            self._last_commit = rec
        if self.external_config:
            self._put_external(size)
        return rec

    def _put_external(self, size: int) -> None:
        """Best effort: keep an external config server in line with a committed size."""
        req = urllib.request.Request(self.external_config, data=json.dumps({"size": size}).encode(),
                                     method="PUT", headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=self.http_timeout).close()
        except OSError as e:
            log.warning("could not update config server %s to size %d: %s", self.external_config, size, e)



class _Handler(http.server.BaseHTTPRequestHandler):
    ctl: ElasticController = None
    server_version = "sdprun-config"

    def setup(self):
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + READ_TIMEOUT_S))

    def log_message(self, fmt, *args):  # noqa: D401 - quiet: route to the debug log
        log.debug("config server: " + fmt, *args)

    def log_error(self, fmt, *args):  # a timed-out or malformed request: rate-limited, with the source
        self.server.refusals.refused(self.client_address[0], (fmt % args)[:200])

    def _send(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self, body: bytes = b"") -> bool:
        """Whether the request is signed with the job secret and new; answers 401 (and logs) if not."""
        reason = self.ctl.verifier.check(self.headers.get("Authorization"), self.command, self.path, body)
        if reason is None:
            self.server.slots.done(self.connection)  # (signed: it holds no stranger's slot)
            return True
        self._refuse(reason)
        return False

    def _refuse(self, reason: str) -> None:
        self.server.refusals.refused(self.client_address[0], f"{self.command} {self.path[:100]}: {reason}")
        self.close_connection = True
        data = json.dumps({"error": f"unauthorized: {reason}; requests must be signed with the job secret "
                                    "(sdp.transport.security.http_authorization)"}).encode()
        self.send_response(401)
        self.send_header("WWW-Authenticate", f'{security.HTTP_SCHEME} realm="sdprun"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _raw_body(self) -> bytes:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ValueError("Content-Length is not a number") from None
        if not 0 <= n <= MAX_BODY_BYTES:
            self.close_connection = True
            raise ValueError(f"request body of {n} bytes (at most {MAX_BODY_BYTES})")
        return self.rfile.read(n)

    @staticmethod
    def _json(raw: bytes):
        try:
            return json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            raise ValueError("the request body is not JSON") from None

    def _path(self) -> str:
        return urllib.parse.urlparse(self.path).path.rstrip("/") or "/"

    def do_GET(self):
        if not self._authorized():
            return
        path = self._path()
        if path == "/config":
            cfg = self.ctl.get_config()
            self._send(200, cfg) if cfg is not None else self._send(404, {"error": "no cluster config (cleared)"})
        elif path in ("/status", "/"):
            self._send(200, self.ctl.status())
        else:
            self._send(404, {"error": f"no such endpoint {path}"})

    def _write(self):
        if security.HttpVerifier.parse(self.headers.get("Authorization")) is None:
            self._refuse(f"no {security.HTTP_SCHEME} authorization")  # before reading any body
            return
        try:
            raw = self._raw_body()
        except ValueError as e:
            self._send(400, {"error": str(e)})
            return
        if not self._authorized(raw):
            return
        path = self._path()
        try:
            if path == "/config" and self.command == "DELETE" and hasattr(self.ctl, "clear_config"):
                self._send(200, self.ctl.clear_config())
            elif path == "/config" and self.command == "POST" and not raw.strip() and hasattr(self.ctl, "reset_config"):
                self._send(200, self.ctl.reset_config())
            elif path == "/config":
                self._send(200, self.ctl.put_config(self._json(raw)))
            elif path == "/resize" and self.ctl.commit_path == "/resize":
                self._send(200, self.ctl.commit(self._json(raw)))
            elif path == "/join" and self.ctl.commit_path == "/join":
                self._send(200, self.ctl.join(self._json(raw)))
            else:
                self._send(404, {"error": f"no such endpoint {path}"})
        except ConflictError as e:
            self._send(409, {"error": str(e)})
        except ValueError as e:
            self._send(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - the worker gets the reason
            log.exception("config server: %s %s failed", self.command, path)
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    do_PUT = _write
    do_POST = _write
    do_DELETE = _write
