"""``sdprun``: start N sdp worker processes on this and other hosts (like horovodrun/kungfu-run).

Usage::

    sdprun -np 4 [-H localhost:4 | -H h1:2,h2:2 | --hostfile FILE] [options] [--] python train.py ...
    sdprun --check -H h1:2,h2:2       # per host: reachable, Python, sdp, free /dev/shm, interface

``--launcher`` picks how ranks start: ``ssh`` (below), ``mpi`` (one Open MPI ``mpirun``,
:mod:`sdp.launcher.mpi`) or ``slurm`` (one ``srun`` job step, :mod:`sdp.launcher.slurm`); the
default ``auto`` is ``slurm`` inside a Slurm allocation (``SLURM_JOB_ID``) without
``-H``/``--hostfile``, else ``ssh``.  With ``mpi``/``slurm`` the ranks get the job variables below
except the per-rank ones (``SDP_RANK`` ...), which the engine's own variables replace.

With ``ssh``, ranks on this machine are started directly (:mod:`sdp.launcher.local`), ranks on
other hosts through the system OpenSSH client (:mod:`sdp.launcher.ssh`: ``BatchMode=yes``, ``--ssh-port``,
``--ssh-identity-file``; the same Python environment at the same path on every host).  Remote ranks
get the working directory, ``PATH``, ``PYTHONPATH``, ``LD_LIBRARY_PATH``, every ``SDP_*``,
``HOROVOD_*``, ``TF_*`` variable and each ``-x NAME[=VALUE]``.  Each job has a secret
(``SDP_SECRET``, made here by :func:`sdp.transport.security.new_secret`), given to local ranks in
their environment and to remote ones over ssh's standard input, never on a command line.

Every worker gets ``SDP_RANK``, ``SDP_SIZE``, ``SDP_LOCAL_RANK``, ``SDP_LOCAL_SIZE``,
``SDP_CROSS_RANK``, ``SDP_CROSS_SIZE``, ``SDP_HOSTNAME``, ``SDP_RENDEZVOUS_ADDR`` (served by
``sdprun`` itself: on ``-nic``'s address, else on the address that routes to the remote hosts, else
127.0.0.1), ``SDP_JOB_ID`` (random hex, unique per launch), ``SDP_SECRET``, ``SDP_START_TIMEOUT`` and
``PYTHONUNBUFFERED=1``; plus ``SDP_IFACE`` with ``-nic``; and glibc's
``x86_non_temporal_threshold`` tunable (see :func:`with_streaming_copies`).  ``--compat horovod,smdistributed,kungfu``
(any comma list, or ``all``) exports ``SDP_COMPAT`` and puts sdp's import-shim directory first on
``PYTHONPATH``, so that ``import horovod.tensorflow`` etc. give sdp in the workers (see sdp.compat).
Output lines are prefixed ``[rank]<stdout>:`` / ``[rank]<stderr>:``.  If a worker fails, the others
are stopped and ``sdprun`` exits with that worker's status; SIGINT/SIGTERM to ``sdprun`` are
forwarded to all workers.

Elastic (watch) mode: ``sdprun -w [--builtin-config-port PORT] [--config-server URL]`` serves a
config server; workers resize the job with the KungFu bridge (``resize(n)``, ``resize()`` after
``propose_new_size(n)`` or a ``PUT`` to the config server); ``sdprun`` starts the new workers and
the removed ones exit.  See :mod:`sdp.launcher.elastic`.

``kungfu-run`` flags and their ``sdprun`` meaning:

=========================  =====================================================================
``-np N``                  ``-np N``: number of workers (the initial size with ``-w``)
``-H h1:n1,h2:n2``         ``-H``: hosts and slots (other hosts through ssh); with ``-w``
                           the slots bound how far the job can grow (default: 64 on this machine)
``-nic IFACE``             ``-nic``: network interface: sdprun's servers listen on its address,
                           ``SDP_IFACE`` for the workers
``-w``                     ``-w`` / ``--watch``: elastic mode
``-builtin-config-port P`` ``--builtin-config-port P``: the built-in config server's port (implies -w)
``-config-server URL``     ``--config-server URL``: where workers read the desired size (implies -w)
``-q``                     ``-q``: sdprun's own messages only for warnings and errors
``-logdir DIR``            ``-logdir``: each worker's output also in ``DIR/worker<K>.rank<R>.std{out,err}.log``
``-strategy``              accepted and ignored
=========================  =====================================================================

horovodrun's ``-p/--ssh-port``, ``-i/--ssh-identity-file``, ``--hostfile``,
``--network-interface``, ``--start-timeout`` and mpirun's ``-x NAME[=VALUE]`` mean the same here.

For testing multi-host topologies without other hosts, set ``SDP_LAUNCHER_ALLOW_FAKE_HOSTS=1``:
every process runs locally (no ssh) and ``SDP_HOSTNAME`` tells each worker its pretend host.
"""
import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from typing import List, Optional

from sdp.common import compat_names, network
from sdp.launcher import hosts as hostlib
from sdp.launcher import mpi, slurm
from sdp.launcher.jobenv import (NON_TEMPORAL_BYTES, NON_TEMPORAL_TUNABLE, STREAMING_COPIES,  # noqa: F401
                                 job_env, parse_exports, with_streaming_copies, worker_envs)
from sdp.launcher.placement import Launchers
from sdp.launcher.procs import DEFAULT_GRACE_S, WorkerGroup
from sdp.launcher.ssh import SshOptions, probe_host
from sdp.transport import security

log = logging.getLogger("sdp.launcher")

ALLOW_FAKE_HOSTS_ENV = "SDP_LAUNCHER_ALLOW_FAKE_HOSTS"
COMPAT_CHOICES = compat_names.FAMILIES
EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126


def _compat_list(value: str) -> str:
    """``--compat`` value: a comma list of COMPAT_CHOICES (or ``all``), normalized."""
    try:
        families = compat_names.parse_families(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    if not families:
        raise argparse.ArgumentTypeError(f"give one or more of {', '.join(COMPAT_CHOICES)}")
    return ",".join(families)


def build_parser() -> argparse.ArgumentParser:
    """The ``sdprun`` argument parser (horovodrun and kungfu-run spellings accepted), its options
    grouped as ``horovodrun --help`` groups them."""
    p = argparse.ArgumentParser(
        prog="sdprun", allow_abbrev=False,
        usage="sdprun [-h] [-np N] [-H HOSTS | --hostfile FILE] [options] [--] COMMAND ...\n"
              "       sdprun --check [-H HOSTS | --hostfile FILE] [-p PORT] [-i FILE] [-nic IFACE]",
        description="Start N sdp worker processes on this machine and, through ssh, on other hosts.\n"
                    "horovodrun and kungfu-run command lines are accepted.\n\n"
                    "Only COMMAND is required: -np defaults to the slots of -H/--hostfile, and sdprun\n"
                    "derives each rank's SDP_RANK, SDP_LOCAL_RANK, ... from the host list, serves the\n"
                    "rendezvous and makes the job's secret.",
        epilog="examples:\n"
               "  sdprun -np 2 python train.py                      # 2 ranks on this machine\n"
               "  sdprun -np 8 -H h1:4,h2:4 python train.py         # 2 hosts, over ssh\n"
               "  sdprun --compat horovod -np 2 python hvd_train.py # an unmodified Horovod script\n"
               "  sdprun --check -H h1:4,h2:4                       # can every host run ranks?\n"
               "\nCtrl-C / SIGTERM: forwarded to every rank, which ends with one line; ranks\n"
               "still running 3 s later are killed.  A rank that rank 0's stall check names\n"
               "(SDP_STALL_CHECK_TIME) is asked once for its Python stacks.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the program to run on every rank and its arguments (required)")

    procs = p.add_argument_group("processes and hosts (horovodrun's and kungfu-run's names)")
    procs.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N",
                       help="number of processes (default: the total slots of -H/--hostfile, "
                            "SLURM_NTASKS with --launcher slurm)")
    hosts = procs.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS[,...]",
                       help="hosts and their slots, e.g. localhost:4 (default: N slots on this machine)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="file with one 'host slots=N' or 'host:N' per line")
    procs.add_argument("--launcher", choices=("auto", "ssh", "mpi", "slurm"), default="auto",
                       help="how ranks are started: ssh (this machine directly, other hosts through "
                            "ssh), mpi (one Open MPI mpirun), slurm (one srun job step inside an "
                            "allocation); default auto: slurm inside an allocation (SLURM_JOB_ID) "
                            "without -H/--hostfile, else ssh")
    procs.add_argument("--check", action="store_true",
                       help="check the hosts and exit: per host whether ssh reaches it, its Python and "
                            "sdp versions, free /dev/shm, and the interface it would use")
    procs.add_argument("--start-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="how long ranks may take to reach rendezvous (default 60); "
                            "passed to workers as SDP_START_TIMEOUT")

    net = p.add_argument_group("network and ssh (horovodrun's names)")
    net.add_argument("-nic", "--network-interface", dest="nic", metavar="IFACE",
                     help="network interface for all job traffic: sdprun's servers listen on its "
                          "address; passed to workers as SDP_IFACE (default: $SDP_IFACE, else the "
                          "interface that routes to the remote hosts)")
    net.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                     help="ssh port of the remote hosts (default: ssh's own, usually 22)")
    net.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                     help="private key ssh uses to log in to the remote hosts")

    env = p.add_argument_group("environment and output")
    env.add_argument("-x", dest="export", action="append", default=[], metavar="NAME[=VALUE]",
                     help="also give every rank this variable (this environment's value, or VALUE); "
                          "repeatable (mpirun's -x)")
    env.add_argument("--compat", type=_compat_list, metavar="{horovod,smdistributed,kungfu}[,...]",
                     help="let unmodified horovod/smdistributed/kungfu scripts import sdp (comma list "
                          "or 'all'); a real installation is kept unless SDP_COMPAT_FORCE=1")
    env.add_argument("--verbose", action="store_true", help="log launcher details (rank table, pids)")
    env.add_argument("--no-prefix", action="store_true",
                     help="do not prefix output lines with [rank]<stdout>: / [rank]<stderr>:")
    env.add_argument("-q", dest="quiet", action="store_true",
                     help="kungfu-run's quiet mode: sdprun's own messages only for warnings and errors")
    env.add_argument("-logdir", dest="logdir", metavar="DIR",
                     help="kungfu-run's log directory: each worker's output also goes to "
                          "DIR/worker<K>.rank<R>.stdout.log / .stderr.log")

    # horovodrun's elastic mode (Horovod Elastic); see sdp.launcher.elastic.HorovodElasticDriver
    el = p.add_argument_group("elastic: Horovod Elastic (horovodrun's names)")
    el.add_argument("--host-discovery-script", metavar="SCRIPT",
                    help="elastic mode: run SCRIPT every second; it prints 'host:slots' lines (other hosts "
                         "through ssh, as with -H)")
    el.add_argument("--min-np", type=int, metavar="N", help="stop the job below N workers (default: -np)")
    el.add_argument("--max-np", type=int, metavar="N", help="grow the job to at most N workers (default: no limit)")
    el.add_argument("--slots-per-host", type=int, metavar="N", help="slots of a discovered host given without ':slots'")
    el.add_argument("--reset-limit", type=int, metavar="K", help="stop the job after K re-formations")
    el.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="how long a re-formation may wait for workers to ask for it or for --min-np slots "
                         "(default 600)")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                    help="a host whose workers all failed comes back after a random MIN..MAX seconds "
                         "(default: never)")

    # kungfu-run's elastic mode; see sdp.launcher.elastic
    kf = p.add_argument_group("elastic: KungFu watch mode (kungfu-run's names)")
    kf.add_argument("-w", "--watch", action="store_true",
                    help="elastic mode: serve a config server and grow/shrink the job when the "
                         "workers resize (KungFu resize / propose_new_size)")
    kf.add_argument("--config-server", "-config-server", dest="config_server", metavar="URL",
                    help="config server the workers read the desired cluster size from "
                         "(default with -w: the built-in one, http://127.0.0.1:PORT/config); implies -w")
    kf.add_argument("--builtin-config-port", "-builtin-config-port", dest="builtin_config_port",
                    type=int, metavar="PORT",
                    help="port of the built-in config server (on sdprun's listen address, 127.0.0.1 for "
                         "a local job; default: a free port); implies -w")

    # Accepted so pasted horovodrun / kungfu-run command lines work; they change nothing here.
    ign = p.add_argument_group("accepted and ignored (horovodrun's and kungfu-run's)")
    ign.add_argument("--gloo", "--mpi", action="store_true", dest="ignored_controller",
                     help="horovodrun's controller choice; sdp uses its own transport")
    ign.add_argument("-strategy", dest="ignored_strategy", metavar="NAME",
                     help="kungfu-run's allreduce strategy")
    return p


def _setup_logging(verbose: bool, quiet: bool = False) -> None:
    logger = logging.getLogger("sdp")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("sdprun %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)


def resolve_hosts(args) -> List[hostlib.HostSlots]:
    """Host list from ``-H``/``--hostfile`` (default: ``args.np`` slots on this machine).

    Raises ``ValueError`` for a bad host list, ``OSError`` for an unreadable hostfile."""
    if args.hosts:
        return hostlib.parse_hosts(args.hosts)
    if args.hostfile:
        return hostlib.parse_hostfile(args.hostfile)
    if args.np is None:
        raise ValueError("give the number of processes with -np N")
    return [hostlib.HostSlots(socket.gethostname(), max(args.np, 1))]


def remote_hosts(hosts: List[hostlib.HostSlots], allow_fake: bool = False) -> List[str]:
    """The hosts of ``hosts`` that are not this machine (none in fake-hosts mode)."""
    if allow_fake:
        return []
    names = hostlib.local_names()
    return [h.host for h in hosts if not hostlib.is_local(h.host, names)]


def listen_address(remote: List[str], nic: Optional[str]) -> str:
    """Where ``sdprun``'s servers listen: ``nic``'s IPv4 address (``-nic``, else ``SDP_IFACE``);
    else the local address that routes to the first remote host; 127.0.0.1 when every rank is
    local.  Never ``0.0.0.0``.  Raises ``ValueError`` for an unknown interface."""
    iface = nic or os.environ.get(network.IFACE_ENV)
    if iface:
        return network.interface_address(iface)
    return network.address_towards(remote[0]) if remote else network.LOOPBACK


def check_hosts(hosts: List[hostlib.HostSlots], remote: List[str], args, out=None) -> int:
    """``sdprun --check``: print one line per host; return 0 when every host answered, else 1."""
    out = out or sys.stdout
    options = SshOptions(args.ssh_port, args.ssh_identity_file)
    failed = 0
    for h in hosts:
        is_remote = h.host in remote
        here = listen_address([h.host] if is_remote else remote, args.nic)
        info = probe_host(h.host, options, towards=here if is_remote else None, local=not is_remote)
        if "error" in info:
            failed += 1
            print(f"{h.host}: UNREACHABLE ({'ssh' if is_remote else 'local'}): {info['error']}", file=out)
            continue
        shm = f"{info['shm_free'] / 2**30:.1f} GiB" if info.get("shm_free") is not None else "none"
        if is_remote:
            iface = (f"interface {info.get('iface')} ({info.get('address')}) towards sdprun's "
                     f"{here} on {network.interface_of(here)}")
        else:
            iface = f"local, interface {network.interface_of(here)} ({here})"
        print(f"{h.host}: reachable ({'ssh' if is_remote else 'local'}), hostname {info['hostname']}, "
              f"Python {info['python']}, sdp {info['sdp']}, /dev/shm {shm} free, {iface}", file=out)
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None, stdout=None, stderr=None, base_env=None) -> int:
    """Run ``sdprun`` with ``argv`` (default ``sys.argv[1:]``); return the exit status
    (0, the first failing worker's status, 128+signal, 2 for usage errors, 126/127 when the
    command cannot be started).  ``stdout`` / ``stderr`` receive the workers' prefixed lines
    (default: this process's); ``base_env`` is the environment the workers start from
    (default ``os.environ``; :mod:`sdp.launcher.run_func` passes its own)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.check:
        parser.error("no command given (usage: sdprun [-np N] [--] COMMAND ...)")
    if args.start_timeout <= 0:
        parser.error("--start-timeout must be positive")
    _setup_logging(args.verbose, args.quiet)
    if args.ignored_controller or args.ignored_strategy:
        log.debug("ignoring --gloo/--mpi/-strategy: sdp always uses its own ZeroMQ transport")

    watch = bool(args.watch or args.config_server or args.builtin_config_port is not None)
    if args.builtin_config_port is not None and not 0 <= args.builtin_config_port <= 65535:
        parser.error("--builtin-config-port must be in [0, 65535]")

    allow_fake = os.environ.get(ALLOW_FAKE_HOSTS_ENV, "") not in ("", "0")
    if args.check:
        try:
            hosts = resolve_hosts(args) if (args.hosts or args.hostfile or args.np) else \
                [hostlib.HostSlots(socket.gethostname(), 1)]
        except (ValueError, OSError) as e:
            log.error("%s", e)
            return EXIT_USAGE
        return check_hosts(hosts, remote_hosts(hosts), args)
    if args.launcher == "auto":
        args.launcher = "slurm" if (slurm.in_allocation() and not (args.hosts or args.hostfile)
                                    and not watch and not args.host_discovery_script) else "ssh"
    if args.host_discovery_script and (watch or args.launcher not in ("ssh", "auto")):
        parser.error("--host-discovery-script (Horovod Elastic) starts ranks itself: no -w, no --launcher mpi/slurm")
    if args.host_discovery_script and args.np is None:
        args.np = args.min_np
    if watch and args.launcher != "ssh":
        parser.error(f"-w (elastic mode) starts ranks itself; it does not work with --launcher {args.launcher}")
    if args.launcher == "slurm" and (args.hosts or args.hostfile):
        parser.error("--launcher slurm places ranks with Slurm: drop -H/--hostfile "
                     "(choose nodes with salloc/sbatch -N and --ntasks-per-node)")
    tool = None
    if args.launcher in ("mpi", "slurm"):
        try:
            tool = (mpi.find_mpirun if args.launcher == "mpi" else slurm.find_srun)(base_env)
        except FileNotFoundError as e:
            log.error("%s", e)
            return EXIT_NOT_FOUND
    try:
        if args.launcher == "slurm":
            np = args.np if args.np is not None else slurm.default_ntasks()
            if np is None:
                raise ValueError("give the number of processes with -np N (SLURM_NTASKS is not set)")
            args.np = np
            args.hosts = ",".join(f"{n}:{np}" for n in slurm.allocation_nodes()) or None
        hosts = resolve_hosts(args)
        np = args.np if args.np is not None else hostlib.total_slots(hosts)
        if watch and not (args.hosts or args.hostfile):
            from sdp.launcher.elastic import DEFAULT_ELASTIC_SLOTS
            hosts = [hostlib.HostSlots(socket.gethostname(), max(np, DEFAULT_ELASTIC_SLOTS))]
        ranks = hostlib.assign_ranks(hosts, np)
        remote = remote_hosts([h for h in hosts if any(r.hostname == h.host for r in ranks)]
                              if not watch and args.launcher != "slurm" else hosts, allow_fake)
        discovered_first = None
        if args.host_discovery_script and not (args.hosts or args.hostfile):
            from sdp.launcher.horovod_elastic import listen_hosts
            remote, discovered_first = listen_hosts(args, allow_fake)
        host_addr = listen_address(remote, args.nic)
        exports = parse_exports(args.export, base_env)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return EXIT_USAGE
    # every SDP_*/HOROVOD_* setting the ranks would get, checked before one starts: one line each
    from sdp.common.config import check_env
    problems = check_env({**(os.environ if base_env is None else base_env), **exports,
                          "SDP_START_TIMEOUT": f"{args.start_timeout:g}"})
    for problem in problems:
        log.error("%s", problem)
    if problems:
        return EXIT_USAGE

    secret = security.new_secret()
    # sdprun's own servers (the elastic controller's rendezvous rounds too) take it from here
    saved_secret = {k: os.environ.pop(k, None) for k in (security.SECRET_ENV, security.SECRET_FILE_ENV)}
    os.environ[security.SECRET_ENV] = secret
    try:
        if args.host_discovery_script:
            from sdp.launcher.horovod_elastic import run_horovod_elastic
            return run_horovod_elastic(args, command, host_addr, secret, stdout, stderr, base_env, allow_fake,
                                       discovered_first)
        return _launch(args, command, hosts, ranks, remote, host_addr, watch, secret,
                       stdout, stderr, base_env, tool)
    finally:
        for k, v in saved_secret.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch(args, command, hosts, ranks, remote, host_addr, watch, secret, stdout, stderr,
            base_env, tool=None) -> int:
    from sdp.transport.rendezvous import RendezvousServer  # pyzmq only needed for a real launch

    np = len(ranks)
    job_id = secrets.token_hex(8)
    server = RendezvousServer(size=np, host=host_addr, port=0, timeout_s=args.start_timeout,
                              secret=secret).start()
    envs = worker_envs(ranks, server.address, job_id, args, base_env=base_env, secret=secret)
    options = SshOptions(args.ssh_port, args.ssh_identity_file)
    forward = list(parse_exports(args.export, base_env))
    launcher_of = Launchers(options, forward=forward, grace_s=DEFAULT_GRACE_S,
                            allow_fake=os.environ.get(ALLOW_FAKE_HOSTS_ENV, "") not in ("", "0"))

    prefix = not args.no_prefix
    if args.launcher in ("mpi", "slurm"):
        # One mpirun / srun process starts every rank; they read their place from its variables.
        env = job_env(server.address, job_id, args, base_env, secret)
        if args.launcher == "mpi":
            command = mpi.mpirun_argv(hosts, np, command, mpi.exported_names(env, forward), options,
                                      args.nic, mpirun=tool)
        else:
            command = slurm.srun_argv(np, command, srun=tool)
        envs, prefix = [env], False  # (mpirun --tag-output / srun --label prefix the lines)
        log.debug("job %s: %s", job_id, " ".join(command))
    elastic = None
    if watch:
        from sdp.launcher.elastic import ElasticController

        def make_envs(infos, rendezvous_addr, epoch):
            return [dict(e, **elastic.worker_env(epoch))
                    for e in worker_envs(infos, rendezvous_addr, job_id, args, base_env=base_env,
                                         secret=secret)]

        try:
            elastic = ElasticController(hosts, None, make_envs, np, args.start_timeout,
                                        port=args.builtin_config_port or 0, config_server=args.config_server,
                                        host=host_addr, secret=secret)
        except OSError as e:
            log.error("cannot serve the config server on port %s: %s", args.builtin_config_port, e)
            server.stop()
            return EXIT_USAGE
        envs = [dict(e, **elastic.worker_env(0)) for e in envs]
    group = WorkerGroup(command, envs, stdout=stdout, stderr=stderr, prefix=prefix, logdir=getattr(args, "logdir", None),
                        grace_s=DEFAULT_GRACE_S, launcher_of=launcher_of)
    if elastic is not None:
        elastic.group = group
        elastic.start()
        log.info("elastic mode: config server %s (resize via %s/resize)", elastic.config_url, elastic.url)
    log.debug("job %s: %d ranks, rendezvous at %s", job_id, np, server.address)
    for info in ranks if args.launcher == "ssh" else ():
        log.debug("rank %d: host %s (%s) local %d/%d cross %d/%d", info.rank, info.hostname,
                  launcher_of(info.hostname).name, info.local_rank, info.local_size,
                  info.cross_rank, info.cross_size)

    def on_signal(signum, _frame):
        group.request_stop(signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in handled} if in_main else {}
    try:
        try:
            group.start()
        except OSError as e:
            log.error("cannot start %r: %s", command[0], e)
            return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_CANNOT_RUN
        return group.wait()
    finally:
        group.stop(signal.SIGKILL, grace_s=0)  # no-op unless something above went wrong
        if elastic is not None:
            elastic.stop()
        server.stop()
        from sdp.launcher.local import remove_job_files
        if remove_job_files(job_id):
            log.debug("removed shared-memory segments / ipc directories that killed workers left behind")
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
