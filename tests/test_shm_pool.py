"""The shared-memory result pool's allocator (single process, anonymous memory)."""
import gc
import mmap
import threading

import numpy as np

from sdp.transport.shm import ResultPool


def _pool(nbytes=64 * 4096, base=4096):
    mm = mmap.mmap(-1, base + nbytes)
    return ResultPool(mm, base, nbytes), nbytes


def test_blocks_are_aligned_disjoint_and_freed_with_their_last_view():
    pool, total = _pool()
    off1, a = pool.alloc(np.float32, 1000)
    off2, b = pool.alloc(np.float64, 10)
    assert off1 % ResultPool.ALIGN == 0 and off2 % ResultPool.ALIGN == 0 and off1 != off2
    assert a.dtype == np.float32 and a.shape == (1000,) and a.flags.writeable
    a[:] = 1.0
    b[:] = 2.0
    assert np.all(a == 1.0)  # b did not overlap a
    view = a[10:20].reshape(2, 5)
    del a
    gc.collect()
    assert pool.free_bytes() == total - 2 * 4096  # the view keeps a's block
    del view
    assert pool.free_bytes() == total - 4096
    del b
    assert pool.free_bytes() == total


def test_exhaustion_returns_none_and_freed_neighbours_merge():
    pool, total = _pool(nbytes=4 * 4096)
    blocks = [pool.alloc(np.uint8, 4096) for _ in range(4)]
    assert pool.alloc(np.uint8, 1) is None
    del blocks[1], blocks[1]  # free the 2nd and 3rd: one 8 KB hole
    got = pool.alloc(np.uint8, 8192)
    assert got is not None and got[0] == 4096 + 4096
    del got, blocks
    assert pool.free_bytes() == total
    assert pool.alloc(np.uint8, total) is not None  # everything merged back into one block


def test_frees_from_many_threads():
    pool, total = _pool(nbytes=256 * 4096)
    arrays = [pool.alloc(np.float32, 100)[1] for _ in range(200)]
    chunks = [arrays[i::4] for i in range(4)]
    del arrays
    threads = [threading.Thread(target=chunk.clear) for chunk in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.free_bytes() == total
