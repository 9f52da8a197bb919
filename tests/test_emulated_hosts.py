"""The emulated hosts' optional link rate (tests/emulated_hosts.py ``rate=``): each direction of a
host's link is shaped to it, so a benchmark across emulated hosts sees a link slower than the
cores (unshaped, a veth moves several hundred MB/s here)."""
import shutil
import sys

import pytest

import emulated_hosts

RATE, RATE_BYTES_S = "200mbit", 200e6 / 8
SECONDS = 1.0

# bytes/s from the first byte to EOF, as benchmarks/allreduce.py's link test counts
RECEIVE = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 5201)); srv.settimeout(20)
print("ready", flush=True)
conn, _ = srv.accept(); conn.settimeout(20)
got, first = 0, None
while True:
    k = len(conn.recv(1 << 20))
    if not k:
        break
    first = first or time.perf_counter()
    got += k
print(got / (time.perf_counter() - first), flush=True)
"""
SEND = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5201), timeout=20)
data, end = bytes(1 << 20), time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    s.sendall(data)
s.close()
"""


def _rate(hosts, src, dst):
    recv = hosts.popen(dst, [sys.executable, "-c", RECEIVE, hosts.address(dst)], stdout=-1, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        sent = hosts.run(src, [sys.executable, "-c", SEND, hosts.address(dst), str(SECONDS)], timeout=30)
        assert sent.returncode == 0, sent.stderr
        out, _ = recv.communicate(timeout=30)
        return float(out.strip())
    finally:
        recv.kill()


def test_link_rate_shapes_both_directions():
    reason = emulated_hosts.unavailable_reason() or (None if shutil.which("tc") else "no tc (iproute2)")
    if reason:
        pytest.skip(reason)
    with emulated_hosts.EmulatedHosts(2, prefix="sdpr", subnet="10.79.0", rate=RATE) as hosts:
        for src, dst in (("h1", "h2"), ("h2", "h1")):
            rate = _rate(hosts, src, dst)
            # tbf lets one 1 MB burst through at once; TCP/IP headers take ~5%
            assert 0.5 * RATE_BYTES_S < rate < 1.15 * RATE_BYTES_S, (src, dst, rate)
