"""Scripts of tests/test_strangers.py (issue 53): a job that checks its sums, and the strangers that
attack it (run as their own processes: another namespace for TCP, another user for Unix sockets)."""

# A 2 x 2 job's script: small allreduces (the leaders' link), larger ones (the engine), a checksum
# per rank; argv: steps, [how host 1's leader cuts its leaders' link connections at steps 1/4, 2/4
# and 3/4 of the run: "ss" (ss -K: reset, what a middlebox's RST does) or "hook" (shutdown(2) under
# the link)], [repair: 1/0]
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
            if link is not None and r == 0 and cut == "ss":  # (its connections in, to its port, and out)
                os.system(f"ss -K '( sport = :{link.address[1]} or dport = :{link._addr[2][1]} )' >/dev/null")
            elif link is not None and r == 0:  # (host 1's leader shuts its sockets down under the link)
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


# Holds idle connections to every listening socket it finds, ``per`` each, reopened when dropped
# (``refill`` 1) or not (0), looking for new ones every ``period`` s.  ``where``: ``pids:P1,P2``
# (TCP ports on which a process of those processes' network namespaces listens, read from
# /proc/P/net/tcp; sshd's 22 and loopback excepted), ``own:PID`` (TCP ports process PID listens
# on, loopback included) or ``unix:UID`` (as user UID: the abstract ``@sdp-`` sockets of this
# network namespace, from /proc/net/unix).  argv: where, per, period, refill.  Ends at EOF on
# stdin, printing what it did.
STRANGER = r"""
import os, socket, sys, threading, time, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (16384, 16384))
kind, _, arg = sys.argv[1].partition(":")
per, period, refill = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
if kind == "unix":
    os.setgroups([])
    os.setgid(int(arg))
    os.setuid(int(arg))
if kind == "own":
    import psutil
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()

def listening():
    if kind == "unix":
        rows = [ln.split() for ln in open("/proc/net/unix").read().splitlines()[1:]]
        return {f[7] for f in rows if len(f) >= 8 and f[3] == "00010000" and f[7].startswith("@sdp-")}
    if kind == "own":
        try:
            conns = psutil.Process(int(arg)).net_connections(kind="tcp")
        except psutil.Error:
            return set()
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    out = set()
    for pid in arg.split(","):
        try:
            lines = open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]
        except OSError:
            continue
        for f in (ln.split() for ln in lines):
            ip_hex, port_hex = f[1].split(":")
            ip, port = socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1]), int(port_hex, 16)
            if f[3] == "0A" and port != 22 and not ip.startswith("127."):
                out.add((ip, port))
    return out

def connect(t):
    s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET)
    s.setblocking(False)
    try:
        s.connect("\0" + t[1:]) if kind == "unix" else s.connect_ex(t)
    except OSError:
        s.close()
        return None
    return s

held, opened, dropped, next_scan, ready = {}, 0, 0, 0.0, False
while not done.is_set():
    now = time.monotonic()
    if now >= next_scan:
        next_scan = now + period
        for t in listening() - held.keys():
            held[t] = None
    for t, socks in held.items():
        keep = []
        for s in socks or []:
            try:
                if s.recv(1) == b"":
                    raise OSError
                keep.append(s)
            except BlockingIOError:
                keep.append(s)
            except OSError:
                s.close()
                dropped += 1
        while (socks is None or refill) and len(keep) < per:
            s = connect(t)
            if s is None:
                break
            keep.append(s)
            opened += 1
        held[t] = keep
    if not ready:  # (the first scan is done)
        ready = print("scanning", flush=True) or True
    time.sleep(0.01 if kind != "unix" else 0.02)
print("ports", len(held), "opened", opened, "dropped", dropped, flush=True)
"""


# Two ranks on pretend hosts (their mesh over TCP on 127.0.0.1): rank 0 kills the connections to its
# mesh port with ss -K at step 100 of 400; each rank prints its error.
MESH_RESET = r"""
import os, sys, time
import numpy as np
import sdp
sdp.init()
r = sdp.rank()
port = int(sdp.api.runtime().mesh.endpoints["tcp"].rsplit(":", 1)[1])
t0 = time.monotonic()
try:
    for i in range(400):
        if i == 100 and r == 0:
            os.system(f"ss -K dst 127.0.0.1 dport = :{port} >/dev/null 2>&1")
        sdp.allreduce(np.full(50000, float(r + i)), name="big", op=sdp.Sum)
        time.sleep(0.005)
    print("done", flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, str(e).replace("\n", " "), "after %.1f s" % (time.monotonic() - t0), flush=True)
"""
