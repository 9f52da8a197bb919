"""The leaders' link over TCP (sdp.transport.tcp_link): two real ends over loopback sockets in
one process, and the connections a stranger can make to them."""
import logging
import socket
import struct
import threading
import time

import pytest

from sdp.common import errors
from sdp.transport import tcp_link


def _pair(deadline_s=10.0, before_open=None):
    """Leaders 0 and 2 of a job of 3 linked: (link 0, link 2); ``before_open(entries)`` runs
    between rendezvous (the entries) and the open."""
    links = {q: tcp_link.LeaderLink("127.0.0.1", q) for q in (0, 2)}
    entries = {q: {"link_addr": l.address, "link_tokens": l.offer(3)} for q, l in links.items()}
    if before_open is not None:
        before_open(entries)
    deadline = time.monotonic() + deadline_s
    failed = []

    def open_2():
        try:
            links[2].open([0, 2], entries, deadline)
        except Exception as e:  # (reported by the caller)
            failed.append(e)
    t = threading.Thread(target=open_2)
    t.start()
    links[0].open([0, 2], entries, deadline)
    t.join()
    assert not failed, failed
    return links[0], links[2]


def _recv(link, want, timeout_s=5.0):
    got, end = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got += link.recv(50)
    return got


def test_frames_arrive_whole_in_order_and_the_listeners_close():
    a, b = _pair()
    try:
        bodies = [b"", b"x", bytes(range(256)) * 256, memoryview(b"tail" * 1000)]
        for body in bodies:
            a.send(2, body)
        got = _recv(b, len(bodies))
        assert [(src, bytes(f[0])) for src, f in got] == [(0, bytes(x)) for x in bodies]
        b.send(0, b"back")
        assert _recv(a, 1) == [(2, [b"back"])]
        for link in (a, b):  # nothing listens once the link is open
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(tuple(link.address), timeout=2).close()
    finally:
        a.close()
        b.close()
    assert a.recv(10) == [] and b.recv(10) == []
    a.send(2, b"after close")  # (dropped)


def test_strangers_and_replays_are_refused_and_logged_and_the_leaders_still_link(caplog, monkeypatch):
    """Before the leaders open: a connection with a wrong token, one with another leader's
    token for another rank, one that says nothing, one that closes early; then the real
    handshake replayed after it was spent."""
    monkeypatch.setattr(tcp_link, "HANDSHAKE_S", 0.3)
    strangers = []

    def attack(entries):
        addr = tuple(entries[0]["link_addr"])
        token_2 = bytes.fromhex(entries[0]["link_tokens"]["2"])
        for hello in (tcp_link._HELLO.pack(tcp_link.MAGIC, 2, bytes(16)),  # wrong token
                      tcp_link._HELLO.pack(tcp_link.MAGIC, 1, token_2),  # rank 1 is no leader
                      tcp_link._HELLO.pack(b"XXXX", 2, token_2),  # another magic
                      None, b"SDP"):  # silent; closes after 3 bytes
            s = socket.create_connection(addr, timeout=2)
            if hello is not None:
                s.sendall(hello)
                if len(hello) < tcp_link._HELLO.size:
                    s.close()
            strangers.append(s)
    with caplog.at_level(logging.WARNING, logger="sdp.transport"):
        a, b = _pair(before_open=attack)
    try:
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert refused and "127.0.0.1" in refused[0], refused
        a.send(0, b"")  # (no link to itself)
        b.send(0, b"ok")
        assert _recv(a, 1) == [(2, [b"ok"])]
    finally:
        a.close()
        b.close()
        for s in strangers:
            s.close()


def test_a_spent_token_is_refused(caplog):
    """Rank 2's handshake to rank 0, replayed on a second connection after it was admitted, is
    refused and logged (the token is single use), and the first connection carries frames."""
    link = tcp_link.LeaderLink("127.0.0.1", 0)
    tokens = link.offer(3)
    hello = tcp_link._HELLO.pack(tcp_link.MAGIC, 2, bytes.fromhex(tokens["2"]))
    first = socket.create_connection(tuple(link.address), timeout=2)
    first.sendall(hello)
    replay = None
    try:
        link._accept({2}, time.monotonic() + 5)  # (open's accepting half: rank 0 sends nowhere here)
        replay = socket.create_connection(tuple(link.address), timeout=2)
        replay.sendall(hello)
        with caplog.at_level(logging.WARNING, logger="sdp.transport"):
            with pytest.raises(errors.CollectiveTimeoutError):
                link._accept({2}, time.monotonic() + 1.0)
        assert any("spent" in r.getMessage() for r in caplog.records), caplog.records
        first.sendall(struct.pack("<I", 3) + b"abc")
        assert _recv(link, 1) == [(2, [b"abc"])]
    finally:
        link.close()
        first.close()
        if replay is not None:
            replay.close()


def test_a_leader_that_never_connects_is_a_timeout_naming_it():
    link = tcp_link.LeaderLink("127.0.0.1", 0)
    link.offer(2)
    t0 = time.monotonic()
    with pytest.raises(errors.CollectiveTimeoutError, match=r"host leaders \[1\]"):
        link._accept({1}, time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 3
    link.close()


def test_frames_split_across_reads_and_an_oversized_one_closes_the_connection(caplog):
    a, b = _pair()
    try:
        raw = a._out[2]  # (the bytes of frames, written by hand in pieces)
        frame = struct.pack("<I", 5) + b"hello"
        raw.sendall(frame[:3])  # (part of the length)
        assert b.recv(2000) == []
        raw.sendall(frame[3:6])  # (the rest of it, part of the body)
        assert b.recv(2000) == []
        raw.sendall(frame[6:] + frame)  # (the rest, and a whole one)
        assert _recv(b, 2) == [(0, [b"hello"]), (0, [b"hello"])]
        with caplog.at_level(logging.WARNING, logger="sdp.transport"):
            raw.sendall(struct.pack("<I", tcp_link.MAX_FRAME_BYTES + 1) + b"x" * 64)
            assert _recv(b, 1, timeout_s=1.0) == []
        assert any("closing that connection" in r.getMessage() for r in caplog.records)
        assert not b._in  # (the connection from leader 0 is closed)
    finally:
        a.close()
        b.close()
