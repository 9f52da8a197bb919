"""Fixtures shared by the test files that need emulated hosts (tests/emulated_hosts.py)."""
import os
import sys

import pytest

pytest.register_assert_rewrite("replay")  # its helpers' asserts explain failures as tests' do
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated_hosts  # noqa: E402


@pytest.fixture(scope="session")
def hosts():
    """Three emulated hosts h1, h2, h3 with their sshds, made once per session (the multi-host,
    mpirun, Slurm and replay tests share them) and removed at its end.  Their links are shaped to
    ``$SDPT_LINK_RATE`` each way (tc syntax, e.g. ``2gbit``) when it is set, else unshaped."""
    try:
        h = emulated_hosts.EmulatedHosts(3, rate=os.environ.get(emulated_hosts.RATE_ENV)).up()
    except emulated_hosts.HostsUnavailable as e:
        if "not permitted" in str(e).lower():  # root without CAP_NET_ADMIN/CAP_SYS_ADMIN (a container)
            pytest.skip(f"cannot make emulated hosts: {e}")
        raise
    try:
        yield h
    finally:
        h.down()
