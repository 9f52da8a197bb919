"""Scripts of tests/test_strangers.py (issue 53): a job that checks its sums, and the strangers that
attack it (run as their own processes: another namespace for TCP, another user for Unix sockets)."""

# A 2 x 2 job's script: small allreduces (the leaders' link), larger ones (the engine), a checksum
# per rank; argv: steps, [a file whose existence makes the leaders' link sockets be shut down at
# steps 1/4, 2/4 and 3/4 of the run, from a test hook], [repair: 1/0]
JOB = r"""
import os, sys, time
import numpy as np
import sdp
steps = int(sys.argv[1])
cut = sys.argv[2] if len(sys.argv) > 2 else ""
if len(sys.argv) > 3 and sys.argv[3] == "0":
    from sdp.transport import tcp_link
    tcp_link.REPAIR = False
sdp.init()
r, n = sdp.rank(), sdp.size()
total = 0.0
t0 = time.monotonic()
try:
    for i in range(steps):
        if cut and i in (steps // 4, steps // 2, 3 * steps // 4):
            link = sdp.api.runtime().mesh.link
            if link is not None and r == 0:  # (host 1's leader closes its sockets under the link)
                import socket
                with link._lock:
                    for s in list(link._out.values()) + [c.sock for c in link._in.values()]:
                        s.shutdown(socket.SHUT_RDWR)
        small = sdp.allreduce(np.full(256, float(r + i), np.float32), name="small", op=sdp.Sum)
        total += float(small.sum())
        if i % 10 == 0:
            big = sdp.allreduce(np.full(50000, float(r - i), np.float64), name="big", op=sdp.Sum)
            total += float(big.sum())
except Exception as e:
    print("ERROR", type(e).__name__, str(e).replace("\n", " "), "after %.1f s" % (time.monotonic() - t0), flush=True)
    sys.exit(3)
link = sdp.api.runtime().mesh.link
print("checksum", total, "repairs", getattr(link, "repairs", -1), flush=True)
"""


def expected_checksum(steps: int, n: int = 4) -> float:
    ranks = sum(range(n))
    small = sum(256.0 * (ranks + n * i) for i in range(steps))
    big = sum(50000.0 * (ranks - n * i) for i in range(0, steps, 10))
    return small + big


# Holds idle TCP connections to every port on which a process of the given network namespaces
# (read from /proc/<pid>/net/tcp) listens, sshd's 22 and loopback excepted (or, for ``own:PID``,
# on which process PID listens): ``per_port`` each, reopened when dropped (``refill`` 1) or not (0);
# new ports are looked for every ``period`` s.  argv: pids or own:PID, per_port, period, refill.  Ends at EOF on stdin, printing what it did.
TCP_STRANGER = r"""
import os, selectors, socket, sys, threading, time, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (16384, 16384))
own = int(sys.argv[1][4:]) if sys.argv[1].startswith("own:") else None
if own is not None:
    import psutil
pids = [] if own is not None else [int(p) for p in sys.argv[1].split(",")]
per_port, period, refill = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()

def listening():
    out = set()
    if own is not None:  # (one process's own listening sockets, loopback included)
        try:
            conns = psutil.Process(own).net_connections(kind="tcp")
        except psutil.Error:
            return out
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    for pid in pids:
        try:
            lines = open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] != "0A":
                continue
            ip_hex, port_hex = f[1].split(":")
            ip, port = socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1]), int(port_hex, 16)
            if port != 22 and not ip.startswith("127."):
                out.add((ip, port))
    return out

held, seen, opened, dropped = {}, set(), 0, 0
next_scan = 0.0
while not done.is_set():
    now = time.monotonic()
    if now >= next_scan:
        next_scan = now + period
        for t in listening() - seen:
            seen.add(t)
            held[t] = []
    for t, socks in held.items():
        keep = []
        for s in socks:
            try:
                if s.recv(1) == b"":
                    raise OSError
                keep.append(s)
            except BlockingIOError:
                keep.append(s)
            except OSError:
                s.close()
                dropped += 1
        held[t] = keep
        want = per_port - len(keep) if refill or not opened_on.get(t) else 0
        for _ in range(max(0, want)):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(t)
            keep.append(s)
            opened += 1
        opened_on[t] = True
    time.sleep(0.01)
print("ports", len(seen), "opened", opened, "dropped", dropped, flush=True)
""".replace("held, seen,", "opened_on = {}\nheld, seen,")

# The same against the job's abstract Unix sockets (``@sdp-...`` in /proc/net/unix of its
# network namespace), as user ``uid``; argv: uid, per_socket.
UNIX_STRANGER = r"""
import os, socket, sys, threading, time
os.setgroups([])
os.setgid(int(sys.argv[1]))
os.setuid(int(sys.argv[1]))
per = int(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
held, opened, dropped = {}, 0, 0
while not done.is_set():
    names = set()
    for ln in open("/proc/net/unix").read().splitlines()[1:]:
        f = ln.split()
        if len(f) >= 8 and f[3] == "00010000" and f[7].startswith("@sdp-"):
            names.add(f[7])
    for name in names:
        socks = [s for s in held.get(name, []) if s.fileno() >= 0]
        keep = []
        for s in socks:
            try:
                if s.recv(1) == b"":
                    raise OSError
                keep.append(s)
            except BlockingIOError:
                keep.append(s)
            except OSError:
                s.close()
                dropped += 1
        while len(keep) < per:
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect("\0" + name[1:])
            except OSError:
                s.close()
                break
            keep.append(s)
            opened += 1
        held[name] = keep
    time.sleep(0.02)
print("uid", os.getuid(), "opened", opened, "dropped", dropped, flush=True)
"""
