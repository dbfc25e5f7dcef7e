"""The file format of a saved HostTable (version 2), written and read in checksummed chunks.

Layout (all integers little-endian)::

    offset 0     preamble, 20 bytes: magic b"\\x93XFERLIB", format version (uint32, 2),
                 header length H (uint32), CRC-32 of the H header bytes (uint32)
    offset 20    header, H bytes: UTF-8 JSON, padded with spaces so the data starts on a
                 64-byte boundary:
                   {"format": "xferlib.HostTable", "version": 2,
                    "config": the HostTable constructor's arguments,
                    "arrays": [{"name", "dtype", "shape", "offset", "nbytes", "crc32"}, ...],
                    "data_bytes": the length of the data}
    offset 20+H  the arrays, in the order listed: ``weights``, each optimizer slot, each row
                 scalar, ``step`` (int64); each C-ordered and raw, at ``offset`` bytes from
                 the data's start, zero-padded to a multiple of 64 bytes

Every byte is checked when a file is read: magic and version, the header's CRC-32, the
file's exact length, each array's CRC-32 (computed chunk by chunk as it streams in), and the
zero padding. The arrays are the table's named arrays, not its storage rows, so a file does
not depend on how a row and its state are laid out in RAM (``layout.py``).

Why raw arrays: a zip archive of float rows (the ``.npz`` of format 1) saves nothing (float
rows barely compress) and was read through many small buffered reads into a second full-size
copy of the table. Here each chunk (``CHUNK_BYTES``) is copied between the table and one of
two buffers while worker threads checksum it and write or read the other buffer: copies,
CRC-32 and file I/O all release the GIL, so they overlap, and memory holds the table plus the
two buffers.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MAGIC = b"\x93XFERLIB"  # a non-ASCII first byte, as .npy's b"\x93NUMPY": binary, not text
VERSION = 2
FORMAT = "xferlib.HostTable"
ALIGN = 64  # every array starts on a cache line, so a memory map of one is aligned
CHUNK_BYTES = 32 << 20  # per buffer: large enough for disk speed, small next to a table
MAX_HEADER_BYTES = 1 << 24
_PREAMBLE = struct.Struct("<8sIII")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _file_dtype(dtype) -> np.dtype:
    """``dtype`` in little-endian byte order, the file's."""
    dtype = np.dtype(dtype)
    return dtype.newbyteorder("<") if dtype.byteorder == ">" or (
        dtype.byteorder == "=" and sys.byteorder == "big") else dtype


def array_specs(arrays: dict) -> list:
    """The header's description of ``arrays`` (name -> array, first axis the rows): dtype,
    shape, offset from the data's start, byte count; CRC-32s still to be filled in."""
    specs, offset = [], 0
    for name, array in arrays.items():
        dtype = _file_dtype(array.dtype)
        nbytes = int(np.prod(array.shape, dtype=np.int64)) * dtype.itemsize
        specs.append(dict(name=name, dtype=dtype.str, shape=list(array.shape), offset=offset,
                          nbytes=nbytes, crc32="00000000"))
        offset = _align(offset + nbytes)
    return specs


def _json_value(value):
    """JSON's form of a NumPy scalar in the config (an ``lr`` of ``np.float32`` trains as a
    float; ``json`` alone refuses it)."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    raise TypeError(f"cannot save a {type(value).__name__} ({value!r}) in the file's "
                    f"configuration: only numbers, strings, lists and dicts")


def _header_bytes(config: dict, specs: list) -> bytes:
    data_bytes = _align(specs[-1]["offset"] + specs[-1]["nbytes"]) if specs else 0
    text = json.dumps(dict(format=FORMAT, version=VERSION, config=config, arrays=specs,
                           data_bytes=data_bytes), separators=(",", ":"),
                      default=_json_value) + "\n"
    raw = text.encode()
    # CRC-32s are fixed-width hex, so the header written last has the placeholder's length.
    return raw + b" " * (_align(_PREAMBLE.size + len(raw)) - _PREAMBLE.size - len(raw))


def _preamble(header: bytes) -> bytes:
    return _PREAMBLE.pack(MAGIC, VERSION, len(header), zlib.crc32(header))


def write_table_file(fd: int, config: dict, arrays: dict) -> None:
    """Write ``config`` and ``arrays`` to the empty file open for writing at ``fd``: the
    header with placeholder CRC-32s, the data, then the header again with the real ones."""
    specs = array_specs(arrays)
    header = _header_bytes(config, specs)
    _write_all(fd, _preamble(header) + header)
    crcs = _stream(fd, specs, arrays, writing=True)
    for spec in specs:
        spec["crc32"] = f"{crcs[spec['name']]:08x}"
    final = _header_bytes(config, specs)
    assert len(final) == len(header)
    os.lseek(fd, 0, os.SEEK_SET)
    _write_all(fd, _preamble(final) + final)


def is_table_file(head: bytes) -> bool:
    """Whether a file starting with ``head`` is in this format (any version)."""
    return head[:len(MAGIC)] == MAGIC


def open_for_reading(path: str, noun: str, kind: str) -> int:
    """A read-only descriptor of the regular file at ``path``; IsADirectoryError for a
    directory and ValueError for any other kind of file, naming ``path`` (``noun``: what is
    being loaded, "a table"; ``kind``: the files it reads, "HostTable")."""
    import errno
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return fd
    os.close(fd)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"cannot load {noun} from {path}: it is a "
                                f"directory", path)
    raise ValueError(f"{path} is not an xferlib {kind} file (not a regular file)")


def read_header(fd: int, path: str) -> dict:
    """The header of the file at ``fd`` (``path`` names it in errors), checked: magic,
    version, header CRC-32 and the file's length. Leaves ``fd`` at the data's start."""
    size = os.fstat(fd).st_size
    os.lseek(fd, 0, os.SEEK_SET)
    head = _read_bytes(fd, _PREAMBLE.size)
    if len(head) < _PREAMBLE.size or not is_table_file(head):
        raise ValueError(f"{path} is truncated or not an xferlib HostTable file (it starts "
                         f"with {head[:8]!r}, a HostTable file with {MAGIC!r})")
    _, version, length, crc = _PREAMBLE.unpack(head)
    if version != VERSION:
        raise ValueError(f"{path} is an xferlib HostTable file of format version {version}; "
                         f"this xferlib reads version {VERSION} (and format 1, .npz): "
                         f"{'a newer xferlib wrote it' if version > VERSION else 'corrupt'}")
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"{path} is corrupt: its header length {length} is over "
                         f"{MAX_HEADER_BYTES} bytes")
    header = _read_bytes(fd, length)
    if len(header) < length:
        raise ValueError(f"{path} is truncated or not an xferlib HostTable file: "
                         f"{size} bytes, shorter than its {length}-byte header")
    if zlib.crc32(header) != crc:
        raise ValueError(f"{path} is corrupt: its header's CRC-32 is "
                         f"{zlib.crc32(header):08x}, the file says {crc:08x}")
    try:  # the header passed its CRC-32: a bad one here comes from a writer, not the disk
        meta = json.loads(header.decode())
        expected = _PREAMBLE.size + length + int(meta["data_bytes"])
        if (meta["format"], meta["version"]) != (FORMAT, VERSION) or not (
                isinstance(meta["config"], dict) and isinstance(meta["arrays"], list)):
            raise ValueError(f"format {meta['format']!r} version {meta['version']!r}")
        for spec in meta["arrays"]:  # what check_arrays and the CRC-32 check read
            if not (isinstance(spec, dict) and isinstance(spec.get("crc32"), str)):
                raise ValueError(f"array entry {spec!r} without its CRC-32")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is corrupt: its header is not a HostTable header "
                         f"({type(err).__name__}: {err})") from None
    if size != expected:
        what = "truncated" if size < expected else f"{size - expected} bytes too long"
        raise ValueError(f"{path} is truncated or not an xferlib HostTable file: {size} "
                         f"bytes where its header says {expected} ({what}; was the save "
                         f"interrupted, or the file copied in part?)")
    return meta


def check_arrays(meta: dict, arrays: dict, path: str) -> None:
    """ValueError naming each difference between the file's arrays and ``arrays``, those of
    the table its configuration builds."""
    ours = {s["name"]: s for s in array_specs(arrays)}
    theirs = {s.get("name"): s for s in meta["arrays"]}
    keys = ("dtype", "shape", "offset", "nbytes")
    diff = [f"{name!r}: {_describe(theirs.get(name), keys)} in the file, "
            f"{_describe(ours.get(name), keys)} in the table"
            for name in dict.fromkeys([*ours, *theirs])
            if name not in ours or name not in theirs
            or any(ours[name][k] != theirs[name].get(k) for k in keys)]
    if diff or list(ours) != list(theirs):
        raise ValueError(f"{path} does not match the table its configuration makes: "
                         + ("; ".join(diff) if diff else
                            f"arrays in the order {list(theirs)}, expected {list(ours)}"))


def _describe(spec, keys) -> str:
    return "absent" if spec is None else " ".join(f"{k}={spec.get(k)}" for k in keys)


def read_table_file(fd: int, meta: dict, arrays: dict, path: str) -> None:
    """Stream the data of the file at ``fd`` (just past its header) into ``arrays`` (checked
    by :func:`check_arrays`), verifying each array's CRC-32 and the padding."""
    crcs = _stream(fd, array_specs(arrays), arrays, writing=False, path=path)
    for spec in meta["arrays"]:
        if f"{crcs[spec['name']]:08x}" != spec["crc32"]:
            raise ValueError(
                f"{path} is corrupt: the CRC-32 of its {spec['name']!r} array (bytes "
                f"{spec['offset']}-{spec['offset'] + spec['nbytes']} of the data) is "
                f"{crcs[spec['name']]:08x}, the file says {spec['crc32']}")


# ------------------------------------------------------------------ chunked, overlapped I/O


def _pieces(specs: list, chunk_bytes: int):
    """``(spec, first row, stop row, padding bytes)``: each array in pieces of at most
    ``chunk_bytes`` (at least one row), its last piece carrying the zero padding after it."""
    for spec in specs:
        rows = spec["shape"][0] if spec["shape"] else 1
        row_bytes = spec["nbytes"] // rows if rows else 0
        step = max(1, chunk_bytes // max(row_bytes, 1))
        padding = _align(spec["nbytes"]) - spec["nbytes"]
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            yield spec, start, stop, padding if stop == rows else 0


def _stream(fd, specs, arrays, *, writing: bool, path: str = "") -> dict:
    """Copy every array to (``writing``) or from the file at ``fd``'s position, piece by
    piece through two buffers. Three threads overlap: this one copies a piece between the
    table and a buffer, one worker checksums it, another writes or reads a buffer (copies,
    CRC-32 and file I/O all release the GIL). The CRC-32 of each array."""
    pieces = list(_pieces(specs, CHUNK_BYTES))
    size = max((_piece_bytes(*p) for p in pieces), default=0)
    buffers = [np.empty(size, np.uint8) for _ in range(min(2, len(pieces)))]
    crcs = {spec["name"]: 0 for spec in specs}

    def checksum(name, rows):  # on the one checksum thread, so pieces go in order
        crcs[name] = zlib.crc32(rows, crcs[name])

    def views(k):
        spec, start, stop, padding = pieces[k]
        raw = _raw(buffers[k % 2], pieces[k])
        body = raw[:len(raw) - padding]
        return raw, body.view(spec["dtype"]).reshape((stop - start, *spec["shape"][1:]))

    with ThreadPoolExecutor(1, thread_name_prefix="xferlib-table-io") as io, \
            ThreadPoolExecutor(1, thread_name_prefix="xferlib-table-crc") as check:
        busy = [[], []]  # the futures still using each buffer
        try:
            if not writing and pieces:
                busy[0] = [io.submit(_read_once, fd, views(0)[0])]
            for k, (spec, start, stop, padding) in enumerate(pieces):
                raw, rows = views(k)
                name = spec["name"]
                if writing:
                    for future in busy[k % 2]:  # this buffer's previous write and checksum
                        future.result()
                    np.copyto(rows, arrays[name][start:stop])
                    raw[len(raw) - padding:] = 0
                    busy[k % 2] = [check.submit(checksum, name, rows),
                                   io.submit(_write_all, fd, raw)]
                    continue
                got = busy[k % 2][0].result()
                if k + 1 < len(pieces):  # the other buffer's piece was used and checked
                    busy[(k + 1) % 2] = [io.submit(_read_once, fd, views(k + 1)[0])]
                if got < len(raw):
                    raise ValueError(f"{path} is truncated: it ended inside its {name!r} "
                                     f"array (was it cut while this load read it?)")
                if padding and raw[len(raw) - padding:].any():
                    raise ValueError(f"{path} is corrupt: the padding after its {name!r} "
                                     f"array is not zero")
                summed = check.submit(checksum, name, rows)
                np.copyto(arrays[name][start:stop], rows)
                summed.result()
            for future in (*busy[0], *busy[1]):
                future.result()
        except BaseException:
            for future in (*busy[0], *busy[1]):
                future.cancel()
            raise
    return crcs


def _piece_bytes(spec, start, stop, padding) -> int:
    rows = spec["shape"][0] if spec["shape"] else 1
    return (spec["nbytes"] // rows if rows else 0) * (stop - start) + padding


def _raw(buffer, piece) -> np.ndarray:
    return buffer[:_piece_bytes(*piece)]


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Tell the kernel it may drop the file's cached pages (``length`` 0: to the end). A table
    file is read once, into the table: its pages in the page cache would be a second copy of
    the table that only the next allocation evicts (slowly, in a VM that hands freed pages
    back to its host). Dirty pages are not dropped: call after a sync."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _read_once(fd: int, data) -> int:
    """:func:`_read_into`, then the pages read are dropped from the page cache."""
    offset = os.lseek(fd, 0, os.SEEK_CUR)
    got = _read_into(fd, data)
    drop_cached(fd, offset, got)
    return got


def _read_into(fd: int, data) -> int:
    """Bytes read into ``data``: all of it unless the file ends first."""
    view, got = memoryview(data).cast("B"), 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


def _read_bytes(fd: int, n: int) -> bytes:
    data = bytearray(n)
    return bytes(data[:_read_into(fd, data)])
