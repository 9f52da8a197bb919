"""Horovod Elastic's driver: ``sdprun -np N --min-np A --max-np B --host-discovery-script S``.

Across machines (run on one of them; the others through ssh, keys and the same Python
environment at the same path as for ``-H``)::

    sdprun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover.sh \
        [--slots-per-host 2] [--blacklist-cooldown-range 30 60] [-nic eth0] python train.py
    # discover.sh prints the usable hosts now, e.g. "h1:2" and "h2:2" (or "h1", "h2" with
    # --slots-per-host); add a line and the job grows at its next commit, drop one and its
    # workers leave there

:class:`HorovodElasticDriver` runs on the elastic core of :mod:`sdp.launcher.elastic` (the signed
HTTP endpoint, one rendezvous server per epoch) and decides the members of each epoch itself:
survivors of a failure, minus workers on hosts that went away, plus workers it starts on new
slots.  Workers reach it with :func:`sdp.elastic.reset` (``POST /join``) and
:func:`sdp.elastic.hosts_version` (``GET /status``).

Hosts come from the discovery script (:mod:`sdp.launcher.discovery`; a script that fails before
it ever worked stops ``sdprun`` at once with its error, one that fails later keeps the current
hosts, with one warning after ``DISCOVERY_FAILURES_WARN`` failures in a row); workers on this machine
start as child processes, on other hosts through ssh (:class:`sdp.launcher.placement.Launchers`:
the job description with the secret on ssh's standard input, the environment, the working
directory, the remote process group stopped when the session ends), exactly as in a static job.
Each epoch's ranks get their place from the hosts their workers run on
(:func:`sdp.launcher.placement.rank_infos`), so shared memory per host and the hierarchical path
work as in a static job.  ``sdprun`` listens (endpoint and rendezvous) on ``-nic``'s address, else
on the address that routes to the remote hosts the script listed when the job started, else on
127.0.0.1; never on every interface.  A remote host listed while ``sdprun`` listens on 127.0.0.1
cannot reach it: it is skipped with an error naming ``-nic``.

Host changes (checked each time the script runs) count in ``hosts_version``; workers see the count
at their next commit and every rank raises ``HostsUpdatedInterrupt`` there, then asks to re-form:

* a host gone from the script's output (or listing fewer slots): its workers (the highest ranks
  of that host first) are let go: their ``/join`` answer is ``{"leave": why}`` and they exit 0
  (:func:`sdp.elastic.reset`); the others re-form without rollback;
* a host added (or a blacklisted one back after its cooldown, still listed): new workers on its
  slots, up to ``--max-np``; they start from rank 0's state (the ``sync()`` after every re-formation).

Failures: a worker that exits non-zero costs its host that slot while the host still runs live
workers of the job; a host whose workers all failed is blacklisted (for ``random.uniform(*cooldown)``
seconds with ``--blacklist-cooldown-range``, else for the rest of the job).  A host whose link dies
or whose machine stops: the survivors get ``PeerLostError`` (``HorovodInternalError``) from the
transport's fault detection, roll back and ask to re-form, naming the lost rank; once every other
member asked and ``LOST_GRACE_S`` passed, ``sdprun`` stops the workers that did not ask when they,
or another worker of their host, were named lost
(their ssh sessions, which ssh's own keep-alives would end only after 15 s), which blacklists a host
whose workers all went, and re-forms without them.

The job ends with an error below ``--min-np`` when no slot turns up within ``--elastic-timeout``,
when a member does not ask to re-form within it, or after ``--reset-limit`` re-formations.
"""
import logging
import random
import secrets
import signal
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional

from sdp.launcher import discovery
from sdp.launcher import hosts as hostlib
from sdp.launcher.elastic import ElasticController
from sdp.launcher.placement import Launchers, rank_infos

log = logging.getLogger("sdp.launcher")

#: Failed runs in a row of a host discovery script that once worked before ``sdprun`` warns (once).
DISCOVERY_FAILURES_WARN = 3
#: seconds between the last member asking to re-form and ``sdprun`` stopping members that its
#: peers reported lost (a dead link) and that did not ask
LOST_GRACE_S = 1.0


class HorovodElasticDriver(ElasticController):
    """``sdprun --host-discovery-script`` (see the module docstring).

    ``launchers``: the :class:`~sdp.launcher.placement.Launchers` the worker group starts workers
    with (default: this machine only, in fake-hosts mode every name); used here to tell remote
    hosts."""

    commit_path = "/join"

    def __init__(self, discovery_script: str, np: int, min_np: int, max_np: int, group, make_envs: Callable,
                 start_timeout: float, slots_per_host: Optional[int] = None, reset_limit: Optional[int] = None,
                 elastic_timeout: float = 600.0, cooldown=None, discovery_interval: float = 1.0,
                 host: str = "127.0.0.1", secret: Optional[str] = None, launchers: Optional[Launchers] = None):
        super().__init__([hostlib.HostSlots(discovery.LOCALHOST, max_np)], group, make_envs, 0, start_timeout,
                         host=host, secret=secret)
        self.discovery_script = discovery_script
        self._discovery_ok = False  # the script has succeeded once
        self._discovery_failures = 0  # consecutive failures since
        self._warned: set = set()  # output lines logged as unparsable
        self.first_output: Optional[str] = None  # the script's output sdprun read before starting
        self.launchers = launchers or Launchers(allow_fake=True)
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
        self.joined_at = 0.0  # when the last member asked
        self.reported_lost: Dict[int, int] = {}  # worker id -> epoch in which a peer reported it lost
        self.stopped_lost: set = set()  # workers sdprun stopped because their peers lost them
        self.left: Dict[int, str] = {}  # worker id -> why it was let go (its host went away)
        self.exited: Dict[int, int] = {}  # worker id -> exit status
        self.resets = 0
        self.next_worker = 0
        self.stop_reason: Optional[str] = None
        self._answer = threading.Condition(self._lock)
        self._usable_seen: Optional[Dict[str, int]] = None
        self._unreachable = set()

    # -- discovery -------------------------------------------------------------------------
    def discover(self) -> Dict[str, int]:
        """Run the discovery script; returns ``{host: slots}`` (see :meth:`_discovery_failed` for
        a script that fails).  Remote hosts are dropped (with one error each) while ``sdprun``
        listens on a loopback address."""
        try:
            out, self.first_output = self.first_output, None
            if isinstance(out, Exception):  # (sdprun's first run, before the driver: not run twice)
                raise out
            if out is None:
                out = discovery.run_script(self.discovery_script)
            found = discovery.parse(out, self.slots_per_host, self.max_np, allow_fake=self.launchers.allow_fake,
                                    warned=self._warned)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            return self._discovery_failed(e)
        if self._discovery_failures >= DISCOVERY_FAILURES_WARN:
            log.info("host discovery script %s works again", self.discovery_script)
        self._discovery_ok, self._discovery_failures = True, 0
        if self.host.startswith("127."):
            for h in [h for h in found if self.launchers.is_remote(h)]:
                del found[h]
                if h not in self._unreachable:
                    self._unreachable.add(h)
                    log.error("host discovery: %s is another host, but sdprun listens on %s, which it cannot "
                              "reach; give -nic IFACE (the interface towards the hosts) to use it", h, self.host)
        return found

    def _discovery_failed(self, e: Exception) -> Dict[str, int]:
        """A failed run of the script: the job stops (``stop_reason``) with the script's error if
        it never succeeded (it cannot run: no ``#!``, not executable, failing); later, the current
        hosts are kept, with one warning after ``DISCOVERY_FAILURES_WARN`` failures in a row."""
        if isinstance(e, subprocess.CalledProcessError):
            err = (e.stderr or "").strip().splitlines()
            why = f"exited with status {e.returncode}" + (f": {err[-1][:300]}" if err else "")
        elif isinstance(e, subprocess.TimeoutExpired):
            why = f"did not finish within {e.timeout:g} s"
        else:
            why = str(e)
        if not self._discovery_ok:
            with self._lock:
                self.stop_reason = self.stop_reason or (
                    f"host discovery script {self.discovery_script} "
                    f"{'cannot be used' if isinstance(e, ValueError) else 'cannot run'}: {why}")
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
        """Free slots (one host name per slot) beside ``members``, hosts in discovery order."""
        usable = self._usable()
        for w in members:
            h = self.host_of[w]
            usable[h] = usable.get(h, 0) - 1
        return [h for h, n in usable.items() for _ in range(max(n, 0))]

    def _kept(self, live: List[int]) -> List[int]:
        """The members of ``live`` (rank order) whose hosts still have slots for them: the
        lowest ranks of each host keep their slots."""
        budget = self._usable()
        kept = []
        for w in live:
            h = self.host_of[w]
            if budget.get(h, 0) > 0:
                budget[h] -= 1
                kept.append(w)
        return kept

    def _hosts_changed(self) -> None:
        """After a discovery run (lock held): count a change of the usable hosts that matters to
        the running epoch (workers to let go, or free slots below ``--max-np``)."""
        usable = self._usable()
        if usable == self._usable_seen:
            return
        self._usable_seen = usable
        if self.epoch < 0:
            return
        live = self._live()
        gone = [w for w in live if w not in self._kept(live)]
        grow = len(live) < self.max_np and bool(self._free_slots(live))
        if gone or grow:
            self.hosts_version += 1
            what = " and ".join(x for x in (f"lets workers {gone} go" if gone else "",
                                            "grows" if grow else "") if x)
            log.info("elastic: hosts changed (%s); the job %s at its next commit",
                     ", ".join(f"{h}:{n}" for h, n in usable.items()) or "none", what)

    # -- epochs ----------------------------------------------------------------------------
    def _form(self, survivors: List[int], new_hosts: List[str]) -> None:
        """Start epoch ``self.epoch + 1`` of ``survivors`` (in rank order) and new workers on
        ``new_hosts`` (called with the lock held)."""
        from sdp.transport.rendezvous import RendezvousServer
        members = list(survivors)
        for h in new_hosts:
            self.host_of[self.next_worker] = h
            members.append(self.next_worker)
            self.next_worker += 1
        infos = rank_infos([self.host_of[w] for w in members])
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
        self._usable_seen = self._usable()
        log.info("elastic: epoch %d with %d workers (%s)%s", new_epoch, len(members),
                 ", ".join(f"rank {r}: worker {w} on {self.host_of[w]}" for r, w in enumerate(members)),
                 f"; started workers {members[len(survivors):]}" if new_hosts else "")
        for w, env in list(zip(members, envs))[len(survivors):]:
            self.group.add(w, env)
        self._answer.notify_all()

    def join(self, body) -> dict:
        """``POST /join {"worker": id, "epoch": e[, "lost": [ranks of epoch e]]}``: wait (at most
        ``JOIN_POLL_S``) for the epoch after ``e``; answers ``{"epoch", "rendezvous", "env"}``,
        ``{"wait": true}``, ``{"leave": why}`` (the worker's host went away: it exits) or
        ``{"stop": reason}``."""
        from sdp.elastic import JOIN_POLL_S
        try:
            w, e = int(body["worker"]), int(body["epoch"])
            lost = [int(r) for r in body.get("lost", ())][:1024]
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
            raise ValueError("expected {\"worker\": ID, \"epoch\": E[, \"lost\": [RANK, ...]]}") from None
        deadline = time.monotonic() + JOIN_POLL_S
        with self._lock:
            if w not in self.host_of:
                raise ValueError(f"unknown worker {w}")
            if self.epoch == e:
                self.joined[w] = e
                self.joined_at = time.monotonic()
                for r in lost:
                    if 0 <= r < len(self.members) and self.members[r] != w:
                        self.reported_lost[self.members[r]] = e
            while True:
                if self.stop_reason:
                    return {"stop": self.stop_reason}
                if w in self.exited or w in self.stopped_lost:  # a straggler behind a dead link
                    return {"stop": f"worker {w} is no longer part of the job"}
                if w in self.left:
                    return {"leave": self.left[w]}
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
                    "hosts_version": self.hosts_version, "resets": self.resets,
                    "hosts": {self.host_of[w]: sum(self.host_of[x] == self.host_of[w] for x in self.members)
                              for w in self.members},
                    "blacklist": sorted(h for h, t in self.blacklist.items() if t > time.monotonic())}

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
                    self.discovered = found
                    self._hosts_changed()
            with self._lock:
                for wk in group.workers:
                    w = wk.rank
                    rc = None if w in self.exited else wk.proc.poll()
                    if rc is None:
                        continue
                    self.exited[w] = rc
                    if w in self.left:
                        log.info("elastic: worker %d on %s, let go, exited with %d", w, self.host_of[w], rc)
                    elif rc != 0:
                        self._on_failure(w, rc)
                        if failure_code is None:
                            from sdp.launcher.procs import exit_code
                            failure_code = exit_code(rc)
                live = self._live()
                done = [w for w, rc in self.exited.items() if rc == 0 and w not in self.left]
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
            self._stop_lost(missing, now)
            if now - since > t:
                self.stop_reason = f"workers {missing} did not ask to re-form within --elastic-timeout {t:g} s"
        elif self.reset_limit is not None and self.resets >= self.reset_limit:
            self.stop_reason = f"--reset-limit {self.reset_limit} reached"
        else:
            kept = self._kept(live)
            free = self._free_slots(kept)[:max(0, self.max_np - len(kept))]
            if len(kept) + len(free) >= self.min_np:
                self.resets += 1
                for w in live:
                    if w not in kept:
                        self.left[w] = f"host {self.host_of[w]} left the job (host discovery)"
                        log.info("elastic: worker %d on %s is let go: its host left the discovery output",
                                 w, self.host_of[w])
                self._form(kept, free)
                return None
            if now - since > t:
                self.stop_reason = (f"{len(kept) + len(free)} workers, below --min-np {self.min_np}, "
                                    f"for --elastic-timeout {t:g} s")
        return since

    def _stop_lost(self, missing: List[int], now: float) -> None:
        """Stop the members that did not ask to re-form when their peers reported them lost in
        this epoch (a dead link, a stopped machine) and ``LOST_GRACE_S`` passed (lock held)."""
        named = [w for w in missing if self.reported_lost.get(w) == self.epoch]
        down = {self.host_of[w] for w in named}  # a dead link or machine takes every worker of its host
        lost = [w for w in missing if (w in named or self.host_of[w] in down) and w not in self.stopped_lost]
        if not named or len(lost) + len(set(missing) & self.stopped_lost) < len(missing) \
                or now - self.joined_at < LOST_GRACE_S:
            return
        log.warning("elastic: workers %s (on %s) were lost by their peers and did not ask to re-form; "
                    "stopping them", lost, ", ".join(sorted({self.host_of[w] for w in lost})))
        for wk in self.group.workers:
            if wk.rank in lost:
                self.stopped_lost.add(wk.rank)
                wk.proc.signal(signal.SIGKILL)

    def _live(self) -> List[int]:
        """Live members of the current epoch, in rank order."""
        return [w for w in self.members if w not in self.exited]

    def _on_failure(self, w: int, rc: int) -> None:
        h = self.host_of.get(w, discovery.LOCALHOST)
        others = [x for x in self._live() if self.host_of.get(x) == h and x not in self.stopped_lost]
        if others:
            self.failed_slots[h] = self.failed_slots.get(h, 0) + 1
            log.warning("elastic: worker %d on %s exited with %d; the job goes on without that slot (%s still "
                        "runs %d workers)", w, h, rc, h, len(others))
        else:
            until = time.monotonic() + (random.uniform(*self.cooldown) if self.cooldown else float("inf"))
            self.blacklist[h] = until
            self.failed_slots.pop(h, None)
            log.warning("elastic: worker %d on %s exited with %d; host %s blacklisted%s", w, h, rc, h,
                        f" for {until - time.monotonic():.0f} s" if self.cooldown else "")


def listen_hosts(args, allow_fake: bool):
    """``(remote hosts, output)``: the hosts other than this machine the discovery script lists
    now (``sdprun`` listens on the address that routes to the first) and the script's output,
    which the driver takes as its first answer (the script runs once per interval, however it
    counts its runs); ``([], the error)`` when the script fails (the driver reports it, without
    running the script again: a script that hangs stops sdprun after its timeout, not twice that);
    ``([], None)`` in fake-hosts mode."""
    if allow_fake:
        return [], None
    try:
        out = discovery.run_script(args.host_discovery_script)
        found = discovery.parse(out, args.slots_per_host, args.max_np or (1 << 16), warned=set())
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return [], e
    names = hostlib.local_names()
    return [h for h in found if not hostlib.is_local(h, names)], out


def run_horovod_elastic(args, command, host_addr: str, secret: str, stdout=None, stderr=None,
                        base_env=None, allow_fake: bool = False, first_output: Optional[str] = None) -> int:
    """``sdprun --host-discovery-script`` (horovodrun's elastic flags, see
    :class:`HorovodElasticDriver`); returns the exit status.  ``first_output``: the discovery
    script's output already read (:func:`listen_hosts`)."""
    from sdp.launcher.jobenv import parse_exports, worker_envs
    from sdp.launcher.procs import DEFAULT_GRACE_S, WorkerGroup
    from sdp.launcher.ssh import SshOptions

    job_id = secrets.token_hex(8)
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

    launchers = Launchers(SshOptions(args.ssh_port, args.ssh_identity_file),
                          forward=list(parse_exports(args.export, base_env)), grace_s=DEFAULT_GRACE_S,
                          allow_fake=allow_fake)
    group = WorkerGroup(command, [], stdout=stdout, stderr=stderr, prefix=not args.no_prefix,
                        logdir=getattr(args, "logdir", None), grace_s=DEFAULT_GRACE_S, launcher_of=launchers)
    cooldown = tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None
    driver = HorovodElasticDriver(args.host_discovery_script, np, min_np, max_np, group, make_envs,
                                  args.start_timeout, slots_per_host=args.slots_per_host,
                                  reset_limit=args.reset_limit, elastic_timeout=args.elastic_timeout,
                                  cooldown=cooldown, host=host_addr, secret=secret, launchers=launchers)
    driver.first_output = first_output
    driver.start()
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda signum, _f: group.request_stop(signum)) for s in handled} \
        if in_main else {}
    try:
        return driver.run()
    except OSError as e:
        log.error("cannot start %r: %s", command[0], e)
        return 127 if isinstance(e, FileNotFoundError) else 126
    finally:
        group.stop(signal.SIGKILL, grace_s=0)
        driver.stop()
        from sdp.launcher.local import remove_job_files
        remove_job_files(job_id)
        for s, h in previous.items():
            signal.signal(s, h)
