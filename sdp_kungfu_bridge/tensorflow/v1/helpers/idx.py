"""``kungfu.tensorflow.v1.helpers.idx``: the IDX format of the MNIST files (LeCun's page): two zero
bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64),
the number of dimensions, then each dimension as a big-endian uint32, then the data (row-major,
big-endian for multi-byte types).

``read_idx_file(path)`` (a ``.gz`` path, or a path whose ``.gz`` sibling exists, is read through
gzip), ``read_idx_from(f)``, ``read_idx_header(f) -> (type_byte, dims)``, ``write_idx_file(path,
a)``, ``write_idx_to(f, a)``, ``write_idx_header(f, a)``, ``npz2idxtar(npz, out=None)`` (every array
of an ``.npz`` as an IDX member of a tar file; returns its name).  ``ValueError`` for an
unsupported type or a truncated file; the header's sizes are checked against the bytes present
before anything is allocated.
"""
import gzip
import io
import os
import struct
import tarfile

import numpy as np

_TYPES = [(0x08, np.dtype(np.uint8)), (0x09, np.dtype(np.int8)), (0x0B, np.dtype(">i2")),
          (0x0C, np.dtype(">i4")), (0x0D, np.dtype(">f4")), (0x0E, np.dtype(">f8"))]


def _idx_type(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, t in _TYPES:
        if t.kind == dtype.kind and t.itemsize == dtype.itemsize:
            return code
    raise ValueError(f"unsupported dtype for IDX: {dtype}")


def _np_type(code: int) -> np.dtype:
    for c, t in _TYPES:
        if c == code:
            return t
    raise ValueError(f"unsupported IDX type byte 0x{code:02x}")


def write_idx_header(f, a):
    f.write(struct.pack("BBBB", 0, 0, _idx_type(a.dtype), a.ndim))
    for dim in a.shape:
        f.write(struct.pack(">I", dim))


def write_idx_to(f, a):
    a = np.asarray(a)
    write_idx_header(f, a)
    f.write(np.ascontiguousarray(a, dtype=_np_type(_idx_type(a.dtype))).tobytes())


def write_idx_file(name, a):
    with open(name, "wb") as f:
        write_idx_to(f, a)


def read_idx_header(f):
    head = f.read(4)
    if len(head) != 4 or head[0] != 0 or head[1] != 0:
        raise ValueError("not an IDX file (bad magic)")
    code, rank = head[2], head[3]
    raw = f.read(4 * rank)
    if len(raw) != 4 * rank:
        raise ValueError("truncated IDX header")
    return code, list(struct.unpack(">" + "I" * rank, raw))


def read_idx_from(f):
    code, dims = read_idx_header(f)
    dtype = _np_type(code)
    data = f.read()
    want = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != want:
        raise ValueError(f"IDX data has {len(data)} bytes, header {dims} of {dtype} needs {want}")
    return np.frombuffer(data, dtype).astype(dtype.newbyteorder("="), copy=False).reshape(dims)


def _open(name):
    if str(name).endswith(".gz"):
        return gzip.open(name, "rb")
    if not os.path.exists(name) and os.path.exists(str(name) + ".gz"):
        return gzip.open(str(name) + ".gz", "rb")
    return open(name, "rb")


def read_idx_file(name):
    with _open(name) as f:
        return read_idx_from(f)


def npz2idxtar(in_file, out_file=None):
    if out_file is None:
        name = str(in_file)
        out_file = (name[:-4] if name.endswith(".npz") else name) + ".idx.tar"
    arrays = np.load(in_file)
    with tarfile.open(out_file, "w") as tar:
        for name in arrays.files:
            bs = io.BytesIO()
            write_idx_to(bs, arrays[name])
            info = tarfile.TarInfo(name)
            info.size = len(bs.getvalue())
            bs.seek(0)
            tar.addfile(info, bs)
    return out_file
