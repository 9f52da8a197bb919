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

Resources: at most ``MAX_CONNECTIONS`` (128) connections are served at once, one thread each (more
are closed at once); a request must arrive whole, head and body, within ``READ_TIMEOUT_S`` (5 s)
of its connection, however slowly it trickles; the listen backlog is 64.  Refusals and dropped
connections (unsigned, over the cap, timed out, reset while answered) are logged with the source
address, the first at once and the rest as one line per address per 60 s
(:class:`sdp.transport.guard.RefusalLog`), never as a traceback.  Measured: 300 connections
trickling partial requests, then reset, held 128 threads (was one per connection: 294 for 300,
and a ``BrokenPipeError`` traceback per reset one), and one log line (``tests/test_hostile.py``).
"""
import http.server
import io
import json
import logging
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import Callable, Dict, List, Optional

from sdp.common.config import cluster_size_of
from sdp.launcher import hosts as hostlib
from sdp.transport import security

log = logging.getLogger("sdp.launcher")

#: Failed runs in a row of a host discovery script that once worked before ``sdprun`` warns (once).
DISCOVERY_FAILURES_WARN = 3
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
    """``ThreadingHTTPServer`` with at most ``MAX_CONNECTIONS`` connections (threads) at once,
    a read deadline per request (``READ_TIMEOUT_S``), and every refused or failed connection
    logged with its source address, once per address per interval
    (:class:`sdp.transport.guard.RefusalLog`), never as a traceback."""

    daemon_threads = True
    request_queue_size = 64  # listen backlog (socketserver's 5 made connections beyond it wait for SYN retries)

    def __init__(self, address, handler):
        from sdp.transport.guard import RefusalLog
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refusals = RefusalLog("elastic endpoint", log)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refusals.refused(client_address[0], f"{MAX_CONNECTIONS} connections already open")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread for it
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

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
            elif path == "/resize" and not isinstance(self.ctl, HorovodElasticDriver):
                self._send(200, self.ctl.commit(self._json(raw)))
            elif path == "/join" and isinstance(self.ctl, HorovodElasticDriver):
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


# ------------------------------------------------------------------------ Horovod Elastic driver


class HorovodElasticDriver(ElasticController):
    """``sdprun --host-discovery-script``: Horovod Elastic's driver on the elastic core.

    Runs the discovery script every ``discovery_interval`` seconds (its ``host[:slots]`` lines,
    bare hosts get ``slots_per_host``; a script that fails before it ever worked stops ``sdprun``
    at once with its error, one that fails later keeps the current hosts, with one warning after
    ``DISCOVERY_FAILURES_WARN`` failures in a row), starts the first epoch with ``min(np, max_np, slots)``
    workers once ``min_np`` slots are there, and re-forms the job (a new epoch: new ranks
    0..n-1, own rendezvous) when every live member asked for it (``POST /join``, sent by
    :func:`sdp.elastic.reset` after a failed collective or a host change).  A re-formation takes
    the live members (in their old rank order, so rank 0 holds committed state) plus new workers
    on free slots, up to ``max_np``.

    Failed slots: a worker that exits non-zero costs its host that slot while the host still
    runs live workers of the job (always so on one machine); a host whose workers all failed is
    blacklisted (for ``random.uniform(*cooldown)`` seconds with a cooldown range, else for the
    rest of the job).  The job ends with an error below ``min_np`` when no slot turns up within
    ``elastic_timeout`` seconds, when a member does not ask to re-form within it, or after
    ``reset_limit`` re-formations.  Hosts other than this machine are ignored (logged).
    """

    def __init__(self, discovery_script: str, np: int, min_np: int, max_np: int, group, make_envs: Callable,
                 start_timeout: float, slots_per_host: Optional[int] = None, reset_limit: Optional[int] = None,
                 elastic_timeout: float = 600.0, cooldown=None, discovery_interval: float = 1.0,
                 host: str = "127.0.0.1", secret: Optional[str] = None):
        super().__init__([hostlib.HostSlots("localhost", max_np)], group, make_envs, 0, start_timeout,
                         host=host, secret=secret)
        self.discovery_script = discovery_script
        self._discovery_ok = False  # the script has succeeded once
        self._discovery_failures = 0  # consecutive failures since
        self.np, self.min_np, self.max_np = np, min_np, max_np
        self.slots_per_host = slots_per_host
        self.reset_limit = reset_limit
        self.elastic_timeout = elastic_timeout
        self.cooldown = cooldown
        self.discovery_interval = discovery_interval
        self.epoch = -1
        self.hosts_version = 0
        self.discovered: Dict[str, int] = {}
        self.failed_slots: Dict[str, int] = {}
        self.blacklist: Dict[str, float] = {}  # host -> monotonic time it may come back
        self.members: List[int] = []  # worker ids of the current epoch, by rank
        self.host_of: Dict[int, str] = {}
        self.joined: Dict[int, int] = {}  # worker id -> epoch it asked to leave
        self.exited: Dict[int, int] = {}  # worker id -> exit status
        self.resets = 0
        self.next_worker = 0
        self.stop_reason: Optional[str] = None
        self._answer = threading.Condition(self._lock)
        self._warned_remote = set()

    # -- discovery -------------------------------------------------------------------------
    def discover(self) -> Dict[str, int]:
        """Run the discovery script; returns ``{host: slots}`` of usable local hosts (keeps the
        previous answer when the script fails)."""
        import subprocess
        try:
            out = subprocess.run([self.discovery_script], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
        except (OSError, subprocess.SubprocessError) as e:
            return self._discovery_failed(e)
        if self._discovery_failures >= DISCOVERY_FAILURES_WARN:
            log.info("host discovery script %s works again", self.discovery_script)
        self._discovery_ok, self._discovery_failures = True, 0
        found, names = {}, hostlib.local_names()
        for line in out.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            h, sep, n = line.partition(":")
            try:
                slots = int(n) if sep else (self.slots_per_host or 1)
            except ValueError:
                log.warning("host discovery: cannot parse %r (expected host:slots)", line)
                continue
            if not hostlib.is_local(h, names):
                if h not in self._warned_remote:
                    self._warned_remote.add(h)
                    log.warning("host discovery: %s is not this machine; elastic jobs run on local hosts only", h)
                continue
            found["localhost"] = min(self.max_np, found.get("localhost", 0) + max(slots, 0))  # bounded lists
        return found

    def _discovery_failed(self, e: Exception) -> Dict[str, int]:
        """A failed run of the script: the job stops (``stop_reason``) with the script's error if
        it never succeeded (it cannot run: no ``#!``, not executable, failing); later, the current
        hosts are kept, with one warning after ``DISCOVERY_FAILURES_WARN`` failures in a row."""
        import subprocess
        if isinstance(e, subprocess.CalledProcessError):
            err = (e.stderr or "").strip().splitlines()
            why = f"exited with status {e.returncode}" + (f": {err[-1][:300]}" if err else "")
        elif isinstance(e, subprocess.TimeoutExpired):
            why = f"did not finish within {e.timeout:g} s"
        else:
            why = str(e)
        if not self._discovery_ok:
            with self._lock:
                self.stop_reason = self.stop_reason or f"host discovery script {self.discovery_script} cannot run: {why}"
            return self.discovered
        self._discovery_failures += 1
        if self._discovery_failures == DISCOVERY_FAILURES_WARN:
            log.warning("host discovery script %s failed %d times in a row (last: %s); keeping the current "
                        "hosts (%s) until it works again", self.discovery_script, self._discovery_failures, why,
                        ", ".join(f"{h}:{n}" for h, n in self.discovered.items()) or "none")
        else:
            log.debug("host discovery script %s failed: %s", self.discovery_script, why)
        return self.discovered

    def _usable(self) -> Dict[str, int]:
        now = time.monotonic()
        return {h: max(0, n - self.failed_slots.get(h, 0)) for h, n in self.discovered.items()
                if self.blacklist.get(h, 0) <= now}

    def _free_slots(self, members) -> List[str]:
        """Free slots (one host name per slot) beside ``members``."""
        usable = self._usable()
        for w in members:
            h = self.host_of[w]
            usable[h] = usable.get(h, 0) - 1
        return [h for h, n in usable.items() for _ in range(max(n, 0))]

    # -- epochs ----------------------------------------------------------------------------
    def _infos(self, hostnames: List[str]) -> List[hostlib.RankInfo]:
        hosts = list(dict.fromkeys(hostnames))
        out = []
        for r, h in enumerate(hostnames):
            same = [i for i, x in enumerate(hostnames) if x == h]
            lr = same.index(r)
            having = [x for x in hosts if hostnames.count(x) > lr]
            out.append(hostlib.RankInfo(r, len(hostnames), lr, len(same), having.index(h), len(having), h))
        return out

    def _form(self, survivors: List[int], new_hosts: List[str]) -> None:
        """Start epoch ``self.epoch + 1`` of ``survivors`` (in rank order) and new workers on
        ``new_hosts`` (called with the lock held)."""
        from sdp.transport.rendezvous import RendezvousServer
        members = list(survivors)
        for h in new_hosts:
            self.host_of[self.next_worker] = h
            members.append(self.next_worker)
            self.next_worker += 1
        infos = self._infos([self.host_of[w] for w in members])
        new_epoch = self.epoch + 1
        server = RendezvousServer(size=len(members), host=self.host, port=0, timeout_s=self.start_timeout,
                                  secret=self.secret).start()
        envs = self.make_envs(infos, server.address, new_epoch)
        for w, env in zip(members, envs):
            env["SDP_ELASTIC_WORKER"] = str(w)
        for old in list(self._servers):
            self._servers.pop(old).stop()
        self._servers[new_epoch] = server
        self._last_commit = {"epoch": new_epoch, "rendezvous": server.address,
                             "env": {w: info.env() for w, info in zip(members, infos)}}
        self.epoch, self.size, self.members = new_epoch, len(members), members
        self.joined.clear()
        log.info("elastic: epoch %d with %d workers (%s)%s", new_epoch, len(members),
                 ", ".join(f"rank {r}: worker {w}" for r, w in enumerate(members)),
                 f"; started workers {members[len(survivors):]}" if new_hosts else "")
        for w, env in list(zip(members, envs))[len(survivors):]:
            self.group.add(w, env)
        self._answer.notify_all()

    def join(self, body) -> dict:
        """``POST /join {"worker": id, "epoch": e}``: wait (at most ``JOIN_POLL_S``) for the epoch
        after ``e``; answers ``{"epoch", "rendezvous", "env"}``, ``{"wait": true}`` or
        ``{"stop": reason}``."""
        from sdp.elastic import JOIN_POLL_S
        try:
            w, e = int(body["worker"]), int(body["epoch"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ValueError("expected {\"worker\": ID, \"epoch\": E}") from None
        deadline = time.monotonic() + JOIN_POLL_S
        with self._lock:
            if w not in self.host_of:
                raise ValueError(f"unknown worker {w}")
            if self.epoch == e:
                self.joined[w] = e
            while True:
                if self.stop_reason:
                    return {"stop": self.stop_reason}
                rec = self._last_commit
                if rec and rec["epoch"] > e and w in rec["env"]:
                    return {"epoch": rec["epoch"], "rendezvous": rec["rendezvous"], "env": rec["env"][w]}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"wait": True}
                self._answer.wait(left)

    def status(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch, "size": self.size, "members": self.members,
                    "hosts_version": self.hosts_version, "resets": self.resets}

    def _stop(self, reason: str) -> None:
        log.error("elastic: %s; stopping the job", reason)
        with self._lock:
            self.stop_reason = reason
            self._answer.notify_all()

    # -- supervision -----------------------------------------------------------------------
    def run(self) -> int:
        """Supervise the job until it ends; returns ``sdprun``'s exit status."""
        group = self.group
        last_poll = 0.0
        waiting_since = None  # when the first epoch / a re-formation started waiting
        failure_code = None
        while True:
            now = time.monotonic()
            if group._stop_signal is not None:
                signum = group._stop_signal
                log.warning("sdprun received signal %d; stopping the workers", signum)
                group.stop(signum)
                return 128 + signum
            if now - last_poll >= self.discovery_interval:
                last_poll = now
                found = self.discover()
                with self._lock:
                    if found != self.discovered:
                        self.discovered = found
                        if self.epoch >= 0 and self._free_slots(self._live()) and len(self._live()) < self.max_np:
                            self.hosts_version += 1
                            log.info("elastic: hosts changed (%s); the job grows at its next commit",
                                     ", ".join(f"{h}:{n}" for h, n in found.items()))
            with self._lock:
                for wk in group.workers:
                    w = wk.rank
                    rc = None if w in self.exited else wk.proc.poll()
                    if rc is None:
                        continue
                    self.exited[w] = rc
                    if rc != 0:
                        self._on_failure(w, rc)
                        if failure_code is None:
                            from sdp.launcher.procs import exit_code
                            failure_code = exit_code(rc)
                live = self._live()
                done = [w for w, rc in self.exited.items() if rc == 0]
                if self.epoch >= 0 and not live:
                    return 0 if done and not self.stop_reason else (failure_code or 1)
                if not self.stop_reason:
                    waiting_since = self._step(now, waiting_since or now, live, done)
            if self.stop_reason:
                self._stop(self.stop_reason)
                end = time.monotonic() + 2.0  # workers waiting in /join hear why and exit themselves
                while time.monotonic() < end and any(wk.proc.poll() is None for wk in group.workers):
                    time.sleep(0.05)
                group.stop(signal.SIGTERM)
                return failure_code or 1
            group._wakeup.wait(0.05)

    def _step(self, now: float, since: float, live: List[int], done: List[int]) -> Optional[float]:
        """Form the first epoch or a re-formation when due (lock held); returns when the current
        wait started (None when nothing waits).  Sets ``stop_reason`` when the job must end."""
        t = self.elastic_timeout
        if self.epoch < 0:
            free = self._free_slots([])
            n = min(self.np, self.max_np, len(free))
            if n >= self.min_np:
                self._form([], free[:n])
                return None
            if now - since > t:
                self.stop_reason = f"only {n} slots within --elastic-timeout {t:g} s (--min-np {self.min_np})"
            return since
        if not self.joined:
            return None
        missing = [w for w in live if self.joined.get(w) != self.epoch]
        if done and not missing:
            self.stop_reason = f"workers {done} finished while workers {live} asked to re-form"
        elif missing:
            if now - since > t:
                self.stop_reason = f"workers {missing} did not ask to re-form within --elastic-timeout {t:g} s"
        elif self.reset_limit is not None and self.resets >= self.reset_limit:
            self.stop_reason = f"--reset-limit {self.reset_limit} reached"
        else:
            free = self._free_slots(live)[:max(0, self.max_np - len(live))]
            if len(live) + len(free) >= self.min_np:
                self.resets += 1
                self._form(live, free)
                return None
            if now - since > t:
                self.stop_reason = (f"{len(live) + len(free)} workers, below --min-np {self.min_np}, "
                                    f"for --elastic-timeout {t:g} s")
        return since

    def _live(self) -> List[int]:
        """Live members of the current epoch, in rank order."""
        return [w for w in self.members if w not in self.exited]

    def _on_failure(self, w: int, rc: int) -> None:
        h = self.host_of.get(w, "localhost")
        others = [x for x in self._live() if self.host_of.get(x) == h]
        if others:
            self.failed_slots[h] = self.failed_slots.get(h, 0) + 1
            log.warning("elastic: worker %d on %s exited with %d; the job goes on without that slot (%s still "
                        "runs %d workers)", w, h, rc, h, len(others))
        else:
            import random
            until = time.monotonic() + (random.uniform(*self.cooldown) if self.cooldown else float("inf"))
            self.blacklist[h] = until
            self.failed_slots.pop(h, None)
            log.warning("elastic: worker %d on %s exited with %d; host %s blacklisted%s", w, h, rc, h,
                        f" for {until - time.monotonic():.0f} s" if self.cooldown else "")


def run_horovod_elastic(args, command, host_addr: str, secret: str, stdout=None, stderr=None,
                        base_env=None) -> int:
    """``sdprun --host-discovery-script`` (horovodrun's elastic flags, see
    :class:`HorovodElasticDriver`); returns the exit status."""
    import secrets as _secrets
    import signal as _signal

    from sdp.launcher.cli import worker_envs
    from sdp.launcher.procs import DEFAULT_GRACE_S, WorkerGroup

    job_id = _secrets.token_hex(8)
    np = args.np or args.min_np or 1
    min_np = args.min_np or np
    max_np = args.max_np or max(np, 1 << 16)
    if not 1 <= min_np <= np <= max_np:
        log.error("need 1 <= --min-np (%s) <= -np (%s) <= --max-np (%s)", min_np, np, max_np)
        return 2
    driver = None

    def make_envs(infos, rendezvous_addr, epoch):
        return [dict(e, SDP_ELASTIC_URL=driver.url, SDP_ELASTIC_EPOCH=str(epoch),
                     SDP_ELASTIC_TIMEOUT=f"{args.elastic_timeout:g}")
                for e in worker_envs(infos, rendezvous_addr, job_id, args, base_env=base_env, secret=secret)]

    group = WorkerGroup(command, [], stdout=stdout, stderr=stderr, prefix=not args.no_prefix,
                        logdir=getattr(args, "logdir", None),
                        grace_s=DEFAULT_GRACE_S)
    cooldown = tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None
    driver = HorovodElasticDriver(args.host_discovery_script, np, min_np, max_np, group, make_envs,
                                  args.start_timeout, slots_per_host=args.slots_per_host,
                                  reset_limit=args.reset_limit, elastic_timeout=args.elastic_timeout,
                                  cooldown=cooldown, host=host_addr, secret=secret).start()
    handled = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: _signal.signal(s, lambda signum, _f: group.request_stop(signum)) for s in handled} \
        if in_main else {}
    try:
        return driver.run()
    except OSError as e:
        log.error("cannot start %r: %s", command[0], e)
        return 127 if isinstance(e, FileNotFoundError) else 126
    finally:
        group.stop(_signal.SIGKILL, grace_s=0)
        driver.stop()
        from sdp.transport import shm
        shm.remove_job_files(job_id)
        for s, h in previous.items():
            _signal.signal(s, h)
