"""sdp.transport.store: one process, a real server thread and real ZeroMQ sockets."""
import json
import threading
import time

import numpy as np
import pytest
import zmq

from sdp.transport import security
from sdp.transport.store import KEEP_VERSIONS, Client, Server, StoreError, StoreTimeoutError

SECRET = security.new_secret()


@pytest.fixture
def pair():
    server, client = Server("127.0.0.1", secret=SECRET), Client(secret=SECRET)
    yield server, client
    client.close()
    server.close()


def test_latest_and_versions(pair):
    server, client = pair
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    server.save("w", a, version=1)
    a += 1  # the store keeps its own copy
    server.save("w", np.full((3, 4), 7, np.float32), version=2)
    got, ver = client.request(server.address, "w", timeout=5)
    assert ver == 2 and got.dtype == np.float32 and got.shape == (3, 4) and (got == 7).all()
    got, ver = client.request(server.address, "w", version=1, timeout=5)
    assert ver == 1 and np.array_equal(got, np.arange(12, dtype=np.float32).reshape(3, 4))
    for v in range(3, 3 + KEEP_VERSIONS):
        server.save("w", np.zeros(1), version=v)
    with pytest.raises(StoreError, match="version 1 of 'w' is not in the store"):
        client.request(server.address, "w", version=1, timeout=5)


def test_unknown_name_is_an_error(pair):
    server, client = pair
    server.save("w", np.zeros(2))
    with pytest.raises(StoreError, match=r"no variable named 'b'.*saved: \['w'\]"):
        client.request(server.address, "b", timeout=5, peer="rank 1")


def test_foreign_requests_are_dropped_and_the_server_keeps_serving(pair):
    """Malformed requests from a client that holds the secret are dropped and logged."""
    server, client = pair
    server.save("w", np.ones(3, np.int64))
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    security.secure_client(s, SECRET)
    s.connect(server.address)
    s.send(b"\xff not json")
    s.send_multipart([b"two", b"frames"])
    s.send(json.dumps({"no": "id"}).encode())
    s.close()
    got, _ = client.request(server.address, "w", timeout=5)
    assert np.array_equal(got, np.ones(3, np.int64)) and server.served == 1


@pytest.mark.parametrize("intruder", ["no secret", "wrong secret"])
def test_a_client_without_the_job_secret_gets_nothing(pair, intruder):
    """No secret: the CURVE handshake fails; a wrong one: the gatekeeper refuses its key.  The
    server never sees a request and keeps serving its job."""
    server, client = pair
    server.save("w", np.ones(3, np.int64))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    # a send may find no connection to queue on once the server dropped the failed handshake:
    # it would block for ever (it hung CI once), so it gives up after 1 s (nothing got through)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    if intruder == "wrong secret":
        security.secure_client(s, security.new_secret())
    s.connect(server.address)
    try:
        try:
            s.send(json.dumps({"id": 1, "name": "w", "version": None}).encode())
        except zmq.Again:
            pass
        assert not s.poll(500), "an intruder got an answer"
    finally:
        s.close()
        ctx.term()
    with pytest.raises(StoreTimeoutError):
        Client(secret=security.new_secret()).request(server.address, "w", timeout=0.5)
    got, _ = client.request(server.address, "w", timeout=5)
    assert np.array_equal(got, np.ones(3, np.int64)) and server.served == 1


def test_server_refuses_every_interface():
    with pytest.raises(ValueError, match="every interface"):
        Server("0.0.0.0", secret=SECRET)


def _fake_server(ctx):
    """A job-authenticated ROUTER on loopback that the test drives by hand; returns (socket, port)."""
    gate = security.Gatekeeper(ctx, SECRET, "fake")
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    security.secure_server(sock, SECRET)
    return gate, sock, sock.bind_to_random_port("tcp://127.0.0.1")


def test_silent_peer_times_out():
    ctx = zmq.Context()
    gate, mute, port = _fake_server(ctx)  # accepts the request, never answers
    client = Client(secret=SECRET)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"rank 3 .* did not answer a request for 'w' within 0.3 s"):
            client.request(f"tcp://127.0.0.1:{port}", "w", timeout=0.3, peer="rank 3")
        assert time.monotonic() - t0 < 3
    finally:
        client.close()
        mute.close()
        gate.stop()
        ctx.term()


@pytest.mark.parametrize("answer", [[b"not json"], [b"[1, 2]"],
                                    [b'{"id": 1, "ok": true, "dtype": "<f4", "shape": [3]}', b"12345"]])
def test_malformed_answer_is_an_error(answer):
    ctx = zmq.Context()
    gate, fake, port = _fake_server(ctx)  # answers every request with ``answer``
    client = Client(secret=SECRET)
    try:
        address = f"tcp://127.0.0.1:{port}"
        client._socket(address)  # connect first, so the request is not lost

        def serve():
            if fake.poll(5000):
                ident, _ = fake.recv_multipart()
                fake.send_multipart([ident] + answer)

        t = threading.Thread(target=serve)
        t.start()
        with pytest.raises(StoreError, match=r"rank 2 \(tcp://.*\) sent a malformed"):
            client.request(address, "w", timeout=5, peer="rank 2")
        t.join(5)
    finally:
        client.close()
        fake.close()
        gate.stop()
        ctx.term()
