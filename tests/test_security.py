"""Security of sdp's transport (issue 15 item 4, issue 17 malformed rendezvous): real sockets on
loopback, real worker processes; intruders without the job secret (or with a wrong one) connect
to the rendezvous, to every rank's mesh endpoints, to the elastic endpoint, and replay captured
traffic; the job still forms and computes the same results.  (The model store's intruder tests
are in tests/test_store.py.)"""
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import zmq

from harness import check_ok, run_workers
from sdp.common.errors import RendezvousError
from sdp.launcher import hosts
from sdp.launcher.elastic import ElasticController
from sdp.transport import rendezvous, security
from sdp.transport.rendezvous import RendezvousServer

SECRET = security.new_secret()


# ---------------------------------------------------------------------------------------- keys

def test_keys_are_derived_from_the_secret():
    a, b = security.job_keys(SECRET), security.job_keys(security.new_secret())
    assert a == security.job_keys(str(SECRET))  # every rank derives the same keys
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.client_secret) == a.client_public


def test_signed_http_requests_are_valid_once_and_cover_target_and_body():
    v = security.HttpVerifier(SECRET, window_s=60)
    h = security.http_authorization(SECRET, "PUT", "/config", b'{"size": 3}')
    assert v.check(h, "PUT", "/config", b'{"size": 4}') is not None  # body changed
    assert v.check(h, "PUT", "/resize", b'{"size": 3}') is not None  # target changed
    assert v.check(h, "POST", "/config", b'{"size": 3}') is not None  # method changed
    assert v.check(h, "PUT", "/config", b'{"size": 3}') is None
    assert "replayed" in v.check(h, "PUT", "/config", b'{"size": 3}')
    other = security.http_authorization(security.new_secret(), "GET", "/config")
    assert "wrong signature" in v.check(other, "GET", "/config")
    for bad in (None, "", "Bearer x", security.http_authorization(SECRET, "GET", "/")[:-1] + ",x=1", "SDP-HMAC-SHA256 " + "a" * 400):
        assert v.check(bad, "GET", "/") is not None
    old = security.HttpVerifier(SECRET, window_s=-1)  # every timestamp is "too old"
    assert "timestamp" in old.check(security.http_authorization(SECRET, "GET", "/"), "GET", "/")


def test_a_job_of_several_ranks_needs_a_secret():
    assert security.require_secret(1, {}) is None
    assert security.require_secret(2, {"SDP_SECRET": " s3 \n"}) == "s3"
    with pytest.raises(security.SecretError, match="SDP_SECRET_FILE"):
        security.require_secret(2, {})
    results = run_workers(2, "workers_collectives:topology_values", [], timeout=60,
                          per_rank_env=lambda r: {"SDP_SECRET": None})
    assert [r.error_type for r in results] == ["SecretError", "SecretError"], results[0].stderr[-2000:]
    assert max(r.elapsed for r in results) < 30
    # one rank (a plain `python train.py`) opens no socket to anyone and needs none
    one = run_workers(1, "workers_collectives:topology_values", [], timeout=60,
                      per_rank_env=lambda r: {"SDP_SECRET": None})
    assert one[0].ok, one[0].stderr[-2000:]


# ---------------------------------------------------------------------------------- rendezvous

def _register_async(address, rank, size, secret, out):
    def go():
        try:
            out[rank] = rendezvous.register(address, {"rank": rank, "size": size, "host": f"h{rank}"}, 10,
                                            secret=secret)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[rank] = e
    t = threading.Thread(target=go)
    t.start()
    return t


def _raw_request(address, body, secret, wait_s=2.0):
    """Send ``body`` as one REQ frame (CURVE with ``secret``; None: no security); the JSON answer
    or None when there is none within ``wait_s``."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        security.secure_client(s, secret)
    s.connect(address)
    try:
        s.send(body)
        return json.loads(s.recv()) if s.poll(int(wait_s * 1000)) else None
    finally:
        s.close()
        ctx.term()


def test_rendezvous_refuses_every_interface():
    for host in ("*", "0.0.0.0"):
        with pytest.raises(ValueError, match="every interface"):
            RendezvousServer(2, host=host, secret=SECRET)


@pytest.mark.parametrize("intruder_secret", [None, "wrong"])
def test_intruder_cannot_register_and_the_job_forms(intruder_secret):
    srv = RendezvousServer(2, timeout_s=10, secret=SECRET).start()
    try:
        out = {}
        t0 = _register_async(srv.address, 0, 2, SECRET, out)
        key = security.new_secret() if intruder_secret else None
        body = json.dumps({"rank": 1, "size": 2, "host": "intruder", "endpoints": {"tcp": "tcp://6.6.6.6:1"}})
        assert _raw_request(srv.address, body.encode(), key, wait_s=1.0) is None
        t1 = _register_async(srv.address, 1, 2, SECRET, out)
        t0.join(15)
        t1.join(15)
        assert [p["host"] for p in out[0]] == ["h0", "h1"] and out[1] == out[0]
    finally:
        srv.stop()


def test_register_with_a_wrong_secret_fails_in_bounded_time():
    srv = RendezvousServer(2, timeout_s=10, secret=SECRET).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match="same job secret SDP_SECRET"):
            rendezvous.register(srv.address, {"rank": 0, "size": 2}, 1.0, secret=security.new_secret())
        assert time.monotonic() - t0 < 5
    finally:
        srv.stop()


MALFORMED = [b'{"rank": 1e999, "size": 2}', b"[" * 200_000 + b"]" * 200_000, b"{" * 50_000,
             bytes(range(256)) * 4, b'{"rank": "0", "size": 2}', b'{"rank": true, "size": 2}',
             b'{"rank": 0.5, "size": 2}', b'{"rank": 0, "size": -3}', b'[0, 2]', b'"rank"', b"null",
             b'{"rank": 5, "size": 2}', b'{"rank": 0, "size": 99999999999999999999999}']


def test_malformed_rendezvous_requests_get_an_error_and_the_job_forms(caplog):
    srv = RendezvousServer(2, timeout_s=10, secret=SECRET).start()
    try:
        for body in MALFORMED:
            reply = _raw_request(srv.address, body, SECRET)
            assert reply is not None and "error" in reply, (body[:40], reply)
        # a frame over MAX_REQUEST_BYTES: ZeroMQ drops the connection, nobody allocates it
        assert _raw_request(srv.address, b" " * (rendezvous.MAX_REQUEST_BYTES + 1), SECRET, 1.0) is None
        out = {}
        threads = [_register_async(srv.address, r, 2, SECRET, out) for r in (1, 0)]
        for t in threads:
            t.join(15)
        assert [p["rank"] for p in out[0]] == [0, 1] and out[1] == out[0]
    finally:
        srv.stop()
    assert sum("malformed rendezvous request" in r.getMessage() or "refusing" in r.getMessage()
               for r in caplog.records) >= len(MALFORMED)


def test_rank0_served_rendezvous_survives_intruders_and_malformed_requests():
    """Issue 17: without a launcher (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and the user's
    SDP_SECRET), rank 0 serves the rendezvous.  While rank 1 is still starting, an intruder without
    the secret tries to register as rank 1 and a client with it sends every malformed request:
    errors are answered, and the job forms when rank 1 arrives."""
    with socket.socket() as s:  # a free port (the kernel may hand it out again: small race)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sdp_vars = ["SDP_RANK", "SDP_SIZE", "SDP_LOCAL_RANK", "SDP_LOCAL_SIZE", "SDP_CROSS_RANK", "SDP_CROSS_SIZE",
                "SDP_RENDEZVOUS_ADDR"]

    def env(r):
        return dict({k: None for k in sdp_vars}, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), SDP_SECRET=SECRET)

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("results", run_workers(
        2, "workers_security:late_init", [[0, 6]], timeout=60, init=False, per_rank_env=env)))
    t.start()
    address = f"tcp://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while _raw_request(address, MALFORMED[0], SECRET, 0.5) is None:  # until rank 0 serves
        assert time.monotonic() < deadline, "rank 0 never served the rendezvous"
    body = json.dumps({"rank": 1, "size": 2, "host": "intruder", "endpoints": {"tcp": "tcp://6.6.6.6:1"}})
    assert _raw_request(address, body.encode(), None, 0.5) is None
    assert _raw_request(address, body.encode(), security.new_secret(), 0.5) is None
    for b in MALFORMED:
        assert "error" in _raw_request(address, b, SECRET), b[:40]
    t.join(70)
    assert check_ok(out["results"]) == [[0, 2, 3.0], [1, 2, 3.0]]


# ------------------------------------------------------------------------------------ replays

class RecordingProxy:
    """A raw TCP proxy on loopback that forwards one connection to ``target`` and records every
    byte the client sent; ``replay()`` sends the recording again on a new connection."""

    def __init__(self, target_port):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = bytearray()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        self.listener.settimeout(10)
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target, timeout=10)
        stop = threading.Event()

        def pump(src, dst, record):
            src.settimeout(0.2)
            while not stop.is_set():
                try:
                    data = src.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not data:
                    break
                if record:
                    self.sent += data
                try:
                    dst.sendall(data)
                except OSError:
                    break
            stop.set()

        back = threading.Thread(target=pump, args=(server, client, False), daemon=True)
        back.start()
        pump(client, server, True)
        back.join(5)
        client.close()
        server.close()

    def replay(self, wait_s=1.0) -> bytes:
        """Send the recorded bytes to the target again; return what the server answered."""
        s = socket.create_connection(self.target, timeout=wait_s)
        answer = bytearray()
        try:
            s.sendall(bytes(self.sent))
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                try:
                    data = s.recv(65536)
                except socket.timeout:
                    break
                except OSError:
                    break
                if not data:
                    break
                answer += data
        finally:
            s.close()
        return bytes(answer)

    def wait_closed(self, timeout_s):
        """Wait until the proxied connection ended (the client closed it)."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the proxied connection did not end"

    def close(self):
        self.listener.close()
        self._thread.join(5)


@pytest.mark.parametrize("mechanism", ["curve", "single-use token"])
def test_replayed_traffic_is_refused(mechanism):
    """A legit client talks to a job's server through a recording proxy; replaying the recorded
    bytes (handshake and message) on a new connection delivers nothing to the server."""
    ctx = zmq.Context()
    gate = security.Gatekeeper(ctx, SECRET, "replay test")
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    security.secure_server(server, SECRET, encrypt=(mechanism == "curve"))
    port = server.bind_to_random_port("tcp://127.0.0.1")
    proxy = RecordingProxy(port)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.ROUTING_ID, struct.pack("<I", 1))
    client.setsockopt(zmq.RECONNECT_IVL, 60_000)  # one connection: the proxy forwards one
    if mechanism == "curve":
        security.secure_client(client, SECRET)
    else:
        security.secure_client(client, SECRET, "1", gate.issue_token("1"))
    try:
        client.connect(f"tcp://127.0.0.1:{proxy.port}")
        client.send_multipart([b"ABORT", b"stop the job"])
        assert server.poll(5000), "the legit client's message did not arrive"
        assert server.recv_multipart()[1:] == [b"ABORT", b"stop the job"]
        client.close(linger=0)
        proxy.wait_closed(5)  # the client's side of the connection ended: the recording is whole
        assert len(proxy.sent) > 64
        if mechanism == "curve":
            assert b"stop the job" not in proxy.sent  # encrypted on the wire
        rejected = gate.rejected
        proxy.replay(wait_s=1.0)
        assert not server.poll(500), "a replayed connection delivered a message"
        if mechanism != "curve":
            assert gate.rejected == rejected + 1  # the spent token was presented again
    finally:
        proxy.close()
        server.close()
        gate.stop()
        ctx.term()


# --------------------------------------------------------------------------- a job under attack

@pytest.mark.parametrize("encrypt", ["0", "1"])
def test_intruder_on_every_rank_endpoint_is_refused_and_the_job_finishes(encrypt):
    """An intruder process with no secret, with a wrong one, and with guessed tokens sends
    well-formed ABORT and DATA messages to every rank's tcp and ipc endpoint, claiming to be every
    rank of the job, the receiver itself and ranks outside it: nothing gets through, the job
    finishes with the same results."""
    results = run_workers(2, "workers_security:attacked_job", [{}], timeout=90, env={"SDP_ENCRYPT": encrypt})
    values = check_ok(results)
    code, stdout, stderr, took = values[0]["intruder"]
    assert code == 0 and stdout.startswith("intruder done"), stderr
    for r, v in enumerate(values):
        assert v["ok"], v
        assert v["aborted"] == {} and v["stray"] == 0, v
        assert v["encrypt"] == (encrypt == "1")
        assert "refused a connection from " in results[r].stderr, results[r].stderr[-2000:]
        # not one intruder message got past the handshake: none reached the mesh's own filter
        # (which would have dropped the ones claiming a rank outside the job, logging this)
        assert "dropping foreign/malformed message" not in results[r].stderr, results[r].stderr[-2000:]
        assert v["refused_by_gatekeeper"] > 0  # the wrong keys / guessed tokens reached the ZAP handler
        assert v["ipc_dir_mode"] in ("abstract", "0o700")  # no file / a private directory


def test_a_message_claiming_the_receivers_own_rank_is_dropped():
    """Issue 17: such messages were kept forever (512 MiB sent, +513 MiB resident)."""
    results = run_workers(2, "workers_security:claims_own_rank", [None], timeout=60, env={"SDP_ENCRYPT": "1"})
    for r, v in zip(results, check_ok(results)):
        assert v == {"sum": 2.0, "stray": 0}
        assert "dropping foreign/malformed message" in r.stderr, r.stderr[-2000:]


def test_nothing_listens_on_every_interface():
    """Like `ss -ltn` inside the job: every rank's listening TCP sockets are on one address."""
    values = check_ok(run_workers(2, "workers_security:listening_and_modes", [None], timeout=60))
    for v in values:
        assert v["sum"] == 2.0
        assert v["listening"], "the rank listens on nothing?"
        assert all(ip not in ("0.0.0.0", "::") for ip, _ in v["listening"]), v["listening"]
        assert v["ipc_dir_mode"] in ("abstract", "0o700")  # no file / a private directory
        assert v["shm_mode"] in (None, "0o600")


# -------------------------------------------------------------------------- elastic endpoint

def _http(url, method="GET", body=None, secret=SECRET, raw_length=None, authorization=None):
    """One request to ``url``; signed with ``secret`` unless ``authorization`` gives the header
    (None and no secret: unsigned).  Returns (status, JSON answer, the Authorization sent)."""
    data = None if body is None else json.dumps(body).encode()
    if authorization is None and secret is not None:
        authorization = security.http_authorization(secret, method, urllib.parse.urlsplit(url).path, data or b"")
    req = urllib.request.Request(url, method=method, data=data)
    if authorization is not None:
        req.add_header("Authorization", authorization)
    if raw_length is not None:
        req.add_header("Content-Length", str(raw_length))
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), authorization
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), authorization


def test_elastic_endpoint_needs_signed_fresh_requests():
    group = []
    ctl = ElasticController([hosts.HostSlots("localhost", 4)], type("G", (), {"add": lambda s, r, e: group.append(r)})(),
                            lambda infos, addr, epoch: [i.env() for i in infos], initial_size=2, start_timeout=5,
                            secret=SECRET).start()
    try:
        intruders = [dict(secret=None), dict(secret=security.new_secret()),
                     dict(authorization=f"Bearer {SECRET}"), dict(authorization="Basic eDp5")]
        for how in intruders:
            assert _http(ctl.url + "/config", **how)[0] == 401
            assert _http(ctl.url + "/config", "PUT", {"size": 3}, **how)[0] == 401
            assert _http(ctl.url + "/resize", "POST", {"size": 4, "epoch": 0}, **how)[0] == 401
        assert group == [] and ctl.status()["epoch"] == 0 and ctl.status()["desired"] == 2
        # a body bigger than MAX_BODY_BYTES is refused from its header alone
        code, err, _ = _http(ctl.url + "/config", "PUT", {"size": 3}, raw_length=1 << 40)
        assert code == 400 and "at most" in err["error"]
        assert _http(ctl.url + "/config")[0] == 200
        code, cfg, captured = _http(ctl.url + "/config", "PUT", {"size": 3})
        assert code == 200 and cfg["size"] == 3
        # a captured request replayed as is, and with another body under the captured signature
        assert _http(ctl.url + "/config", "PUT", {"size": 3}, authorization=captured)[0] == 401
        assert _http(ctl.url + "/config", "PUT", {"size": 4}, authorization=captured)[0] == 401
        assert ctl.status()["desired"] == 3 and ctl.status()["version"] == 1
    finally:
        ctl.stop()
    with pytest.raises(ValueError, match="every interface"):
        ElasticController([hosts.HostSlots("localhost", 4)], None, None, 1, 5, host="0.0.0.0", secret=SECRET)



# ------------------------------------------------------------------ an intruder on another host

JOB = r"""
import json, os, sys, time
import numpy as np
import sdp
from sdp.transport.zmq_mesh import ABORT, DATA
sdp.init()
flag, mesh = sys.argv[1], sdp.api.runtime().mesh
open(f"{flag}.ready.{sdp.rank()}", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(flag) and time.monotonic() < deadline:
    time.sleep(0.05)
x = sdp.allreduce(np.arange(1000, dtype=np.float32) * (sdp.rank() + 1), name="after", op=sdp.Sum)
stray = sum(len(q) for (s, k), q in mesh.inbox.items() if s == mesh.rank or not 0 <= s < mesh.size or k in (DATA, ABORT))
print("RESULT " + json.dumps({"ok": bool(np.array_equal(x, np.arange(1000, dtype=np.float32) * 3)),
                              "aborted": len(mesh.aborted), "stray": stray, "refused": mesh._gate.rejected}))
"""


def _listening_python(hosts, host):
    """(address, port) of every TCP socket a python process listens on inside ``host`` (`ss -ltnp`)."""
    out = hosts.run(host, ["ss", "-Hltnp"], timeout=10).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 6 and "python" in fields[5]:
            addr, port = fields[3].rsplit(":", 1)
            found.append((addr, int(port)))
    return found


@pytest.mark.slow
def test_intruder_on_another_host_cannot_touch_a_two_host_job(tmp_path):
    """Issue 15's acceptance: `sdprun -H h1:1,h2:1` across two emulated hosts (network namespaces
    on a bridge, sshd each); `ss -ltnp` inside each host shows no sdp socket on 0.0.0.0/*; an
    intruder on h3 sends well-formed ABORT/DATA messages to every port the job listens on (ranks'
    mesh, sdprun's rendezvous) with no secret, a wrong one and guessed tokens; the job's result is
    unchanged and nothing foreign reached a rank."""
    import os
    import subprocess
    import sys

    import emulated_hosts
    from workers_security import INTRUDER

    reason = emulated_hosts.unavailable_reason()
    if reason:
        pytest.skip(reason)
    hosts = emulated_hosts.EmulatedHosts(3, prefix="sdps", subnet="10.78.0")  # beside test_multihost's
    try:
        hosts.up()
    except emulated_hosts.HostsUnavailable as e:
        if "not permitted" in str(e).lower():
            pytest.skip(f"cannot make emulated hosts: {e}")
        raise
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("SDP_SECRET", "SDP_SECRET_FILE", "SDP_IFACE", "SDP_LAUNCHER_ALLOW_FAKE_HOSTS")}
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    script, flag = tmp_path / "job.py", tmp_path / "go"
    script.write_text(JOB)
    job = None
    try:
        job = hosts.popen("h1", [sys.executable, "-m", "sdp.launcher.cli", "-np", "2", "-H", "h1:1,h2:1",
                                 sys.executable, str(script), str(flag)],
                          env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{flag}.ready.{r}") for r in (0, 1)):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job did not start within 60 s"
            time.sleep(0.1)
        endpoints = []
        for h in ("h1", "h2"):
            listening = _listening_python(hosts, h)
            assert listening, f"nothing of the job listens on {h}?"
            assert all(addr == hosts.address(h) for addr, _ in listening), (h, listening)  # not 0.0.0.0, *, [::]
            endpoints += [f"tcp://{addr}:{port}" for addr, port in listening]
        res = hosts.run("h3", [sys.executable, "-c", INTRUDER, json.dumps(endpoints), json.dumps([0, 1, 2, 2 ** 31]),
                               zmq.curve_keypair()[0].decode()], env=env, timeout=60)
        assert res.returncode == 0 and res.stdout.startswith("intruder done"), res.stderr
        flag.touch()
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0, out + err
        results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]
        assert len(results) == 2, out
        for v in results:
            assert v["ok"] and v["aborted"] == 0 and v["stray"] == 0 and v["refused"] > 0, v
        assert "dropping foreign/malformed message" not in err
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.communicate()
        hosts.down()
