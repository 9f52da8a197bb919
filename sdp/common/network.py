"""Which local address sdp binds to and advertises.

Mirrors ``horovodrun --network-interface`` / ``kungfu-run -nic``: with an interface named
(``-nic IFACE``, ``SDP_IFACE``), everything binds to that interface's IPv4 address; without one,
to the address of the interface that routes towards the other hosts; ``127.0.0.1`` when every
rank is on this host.  Nothing binds to ``0.0.0.0``/``*``.  Interface addresses come from
psutil (``psutil.net_if_addrs``).
"""
import os
import socket
from typing import Mapping, Optional

import psutil

IFACE_ENV = "SDP_IFACE"
LOOPBACK = "127.0.0.1"


def interface_address(iface: str) -> str:
    """The IPv4 address of network interface ``iface`` (e.g. ``"eth0"``).

    Raises ``ValueError`` naming the interfaces that exist when ``iface`` does not exist or
    has no IPv4 address."""
    addrs = psutil.net_if_addrs()
    for a in addrs.get(iface, ()):
        if a.family == socket.AF_INET:
            return a.address
    have = ", ".join(f"{name} ({a.address})" for name, lst in sorted(addrs.items())
                     for a in lst if a.family == socket.AF_INET)
    raise ValueError(f"network interface {iface!r} {'has no IPv4 address' if iface in addrs else 'does not exist'}; "
                     f"interfaces with IPv4 addresses here: {have or 'none'}")


def interface_of(address: str) -> Optional[str]:
    """The name of the local interface that holds IPv4 ``address``, or None."""
    for name, lst in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in lst):
            return name
    return None


def address_towards(host: str) -> str:
    """The local IPv4 address the kernel would use to reach ``host`` (a name or an address;
    no packet is sent).  ``127.0.0.1`` when ``host`` is this machine or cannot be resolved."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return LOOPBACK


def host_of(address: Optional[str]) -> Optional[str]:
    """``"10.0.0.1"`` from ``"tcp://10.0.0.1:5555"`` (None for None)."""
    if not address:
        return None
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0].strip("[]")


def bind_address(towards: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> str:
    """The address this process binds its listening sockets to: ``SDP_IFACE``'s address when
    set, else the address routing to ``towards`` (a host, or a ``tcp://host:port`` URL, e.g. the
    rendezvous), else loopback.  Raises ``ValueError`` for an unknown ``SDP_IFACE``."""
    env = os.environ if env is None else env
    iface = env.get(IFACE_ENV)
    if iface:
        return interface_address(iface)
    host = host_of(towards) if towards and "://" in towards else towards
    return address_towards(host) if host else LOOPBACK
