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
    entries = {q: {"link_addr": l.address, "link_tokens": l.offer(3), "host": f"h{q}"} for q, l in links.items()}
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


def _hello(token_hex, src, dst, n=0, magic=tcp_link.MAGIC):
    return tcp_link._HELLO.pack(magic, src, n, tcp_link._proof(bytes.fromhex(token_hex), src, dst, n))


def test_frames_arrive_whole_in_order_and_strangers_are_refused_while_the_leaders_listen():
    a, b = _pair()
    try:
        bodies = [b"", b"x", bytes(range(256)) * 256, memoryview(b"tail" * 1000)]
        for body in bodies:
            a.send(2, body)
        got = _recv(b, len(bodies))
        assert [(src, bytes(f[0])) for src, f in got] == [(0, bytes(x)) for x in bodies]
        b.send(0, b"back")
        assert _recv(a, 1) == [(2, [b"back"])]
        for link in (a, b):  # (leaders listen for repairs: a stranger gets nothing, its connection is closed)
            s = socket.create_connection(tuple(link.address), timeout=2)
            s.sendall(bytes(tcp_link._HELLO.size))
            s.settimeout(5)
            assert s.recv(1) == b""
            s.close()
    finally:
        a.close()
        b.close()
    assert a.recv(10) == [] and b.recv(10) == []
    a.send(2, b"after close")  # (dropped)


def test_strangers_and_replays_are_refused_and_logged_and_the_leaders_still_link(caplog, monkeypatch):
    """Before the leaders open: a connection with a wrong proof, one with another leader's
    token for another rank, one with another magic, one that says nothing, one that closes
    early; then the real handshake replayed after it was spent."""
    monkeypatch.setattr(tcp_link, "HANDSHAKE_S", 0.3)
    strangers = []

    def attack(entries):
        addr = tuple(entries[0]["link_addr"])
        token_2 = entries[0]["link_tokens"]["2"]
        for hello in (tcp_link._HELLO.pack(tcp_link.MAGIC, 2, 0, bytes(16)),  # wrong proof
                      _hello(token_2, 1, 0),  # rank 1 is no leader, and the token is rank 2's
                      _hello(token_2, 2, 0, magic=b"XXXX"),  # another magic
                      None, b"SDP"):  # silent; closes after 3 bytes
            s = socket.create_connection(addr, timeout=2)
            if hello is not None:
                s.sendall(hello)
                if len(hello) < tcp_link._HELLO.size:
                    s.close()
            strangers.append(s)
    with caplog.at_level(logging.WARNING, logger="sdp.security"):
        a, b = _pair(before_open=attack)
    try:
        assert _wait(lambda: len([r for r in caplog.records if "refused a connection" in r.getMessage()]) >= 1)
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert "127.0.0.1" in refused[0], refused
        a.send(0, b"")  # (no link to itself)
        b.send(0, b"ok")
        assert _recv(a, 1) == [(2, [b"ok"])]
        replay = socket.create_connection(tuple(a.address), timeout=2)  # rank 2's first handshake, again
        replay.sendall(_hello(entries_of(a, b)[0]["link_tokens"]["2"], 2, 0))
        replay.settimeout(5)
        assert replay.recv(1) == b""  # (closed: spent)
        replay.close()
        b.send(0, b"still")
        assert _recv(a, 1) == [(2, [b"still"])]
    finally:
        a.close()
        b.close()
        for s in strangers:
            s.close()


def entries_of(a, b):
    return {0: {"link_tokens": {"2": a._tokens[2].hex()}}, 2: {"link_tokens": {"0": b._tokens[0].hex()}}}


def _wait(predicate, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_idle_strangers_never_displace_the_genuine_leader():
    """64 idle connections to each leader's port from before the open, reopened as they are
    dropped: the leaders still link at once (on the code before, the genuine leader's was the
    connection refused, or both leaders blocked in connect behind a full backlog, then a
    TimeoutError after 60 s), and the strangers hold at most PENDING_CAP slots."""
    held, stop = [], threading.Event()
    links = {q: tcp_link.LeaderLink("127.0.0.1", q) for q in (0, 2)}

    def hold(addr):
        socks = []
        while not stop.is_set():
            socks = [s for s in socks if s.fileno() >= 0]
            while len(socks) < 64 and not stop.is_set():
                try:
                    socks.append(socket.create_connection(addr, timeout=1))
                except OSError:
                    break
            for s in list(socks):  # (dropped ones are reopened)
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
            time.sleep(0.01)
        held.append(len(socks))
        for s in socks:
            s.close()
    threads = [threading.Thread(target=hold, args=(tuple(l.address),)) for l in links.values()]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)  # (the strangers are in first)
        entries = {q: {"link_addr": l.address, "link_tokens": l.offer(3), "host": f"h{q}"} for q, l in links.items()}
        failed = []
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: _open(links[2], entries, failed))
        t.start()
        links[0].open([0, 2], entries, time.monotonic() + 20)
        t.join()
        assert not failed, failed
        assert time.monotonic() - t0 < 5
        links[0].send(2, b"through")
        assert _recv(links[2], 1) == [(0, [b"through"])]
    finally:
        stop.set()
        for t in threads:
            t.join()
        for l in links.values():
            l.close()


def _open(link, entries, failed):
    try:
        link.open([0, 2], entries, time.monotonic() + 20)
    except Exception as e:  # (reported by the caller)
        failed.append(e)


def test_a_reset_connection_is_repaired_and_its_last_frames_resent(caplog):
    """The connection leader 0 writes is reset (closed under it) three times: each time leader
    0 reconnects with its next single-use proof and resends ``history``; leader 2 adopts the
    new connection; every frame arrives."""
    a, b = _pair()
    try:
        a.history = lambda dst: [b"again"]
        for i in range(3):
            a._out[2].shutdown(socket.SHUT_RDWR)  # (as a reset: both ends see it end)
            a.send(2, b"frame %d" % i)  # (fails, or lands in a dying socket: repaired either way)
            got = _recv(b, 1, timeout_s=5)  # (the send failed on the closed socket: what history gives)
            assert got == [(0, [b"again"])], (i, got)
            assert _wait(lambda: a.direct is not None or a.recv(10) is not None and a.direct is not None)
        assert a.repairs == 3 and a.failed is None and all(s < 2 for s in a.repair_s), a.repair_s
        b.send(0, b"back")
        assert _recv(a, 1) == [(2, [b"back"])]
    finally:
        a.close()
        b.close()


def test_with_repair_off_a_failed_connection_is_a_failure_naming_the_link_and_host(monkeypatch):
    monkeypatch.setattr(tcp_link, "REPAIR", False)
    failures = []
    a, b = _pair()
    try:
        a.on_failure = b.on_failure = lambda q, why: failures.append((q, why))
        a._out[2].shutdown(socket.SHUT_RDWR)
        assert _wait(lambda: (a.recv(10), b.recv(10)) and len(failures) == 2)
        assert {q for q, _ in failures} == {0, 2}
        assert all("leaders' link" in why and "on host h" in why for _, why in failures), failures
    finally:
        a.close()
        b.close()


def test_a_leader_that_never_connects_is_a_timeout_naming_it():
    links = {q: tcp_link.LeaderLink("127.0.0.1", q) for q in (0, 1)}
    entries = {q: {"link_addr": l.address, "link_tokens": l.offer(2), "host": f"h{q}"} for q, l in links.items()}
    t0 = time.monotonic()
    try:
        with pytest.raises(errors.CollectiveTimeoutError, match=r"host leaders \[1\]"):
            links[0].open([0, 1], entries, time.monotonic() + 0.5)  # (leader 1 never opens)
        assert time.monotonic() - t0 < 3
    finally:
        for l in links.values():
            l.close()


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
        a.history = lambda dst: [b"resent"]
        with caplog.at_level(logging.WARNING, logger="sdp.transport"):
            raw.sendall(struct.pack("<I", tcp_link.MAX_FRAME_BYTES + 1) + b"x" * 64)
            assert _recv(b, 1, timeout_s=1.0) == []
            got = []
            assert _wait(lambda: (got.extend(b.recv(10) + a.recv(10)) or True) and (0, [b"resent"]) in got)
        assert any("closing that connection" in r.getMessage() for r in caplog.records)
        assert a.repairs == 1  # (then repaired as a reset one)
    finally:
        a.close()
        b.close()
