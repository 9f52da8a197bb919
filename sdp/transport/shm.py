"""Shared-memory segments for ranks on the same host.

Each rank creates one file in ``/dev/shm`` of ``2 * slab_bytes`` bytes (two halves, used
alternately so one barrier per slab is enough between reuse), advertises its path at rendezvous,
and maps every same-host peer's file.  Files are unlinked as soon as every peer has mapped them,
so nothing is left behind even if a process is killed.  ZeroMQ stays the control path: the
barriers between phases are ZeroMQ messages.
"""
import logging
import mmap
import os

import numpy as np

log = logging.getLogger("sdp.transport")

SHM_DIR = "/dev/shm"


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) and hasattr(mmap, "MAP_SHARED")


def _map(path: str, nbytes: int, create: bool) -> np.ndarray:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS on first touch later
        mflags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, nbytes, flags=mflags)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


class SharedSegments:
    """This rank's segment (``mine``) and views of same-host peers' segments (``peers[rank]``)."""

    def __init__(self, job: str, rank: int, slab_bytes: int):
        """Create this rank's segment.  Raises ``OSError`` (e.g. ENOSPC when /dev/shm is small)."""
        self.slab_bytes = slab_bytes
        self.nbytes = 2 * slab_bytes
        self.path = os.path.join(SHM_DIR, f"sdp-{job}-{rank}-{os.getpid()}")
        try:
            self.mine = _map(self.path, self.nbytes, create=True)
        except OSError:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            raise
        self.peers = {rank: self.mine}
        self._unlinked = False
        self._uses = 0

    def claim(self) -> int:
        """The half (0/1) the next slab must use: halves alternate over the whole job, the same
        sequence on every rank because all ranks run the same collectives in the same order."""
        self._uses += 1
        return self._uses % 2

    def attach(self, rank: int, path: str) -> None:
        self.peers[rank] = _map(path, self.nbytes, create=False)

    def unlink(self) -> None:
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def half(self, rank: int, which: int, dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` in half ``which`` (0/1) of ``rank``'s segment."""
        base = which * self.slab_bytes
        return self.peers[rank][base:base + count * np.dtype(dtype).itemsize].view(dtype)
