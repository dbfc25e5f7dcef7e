"""Host memory shared by the processes of one host, for a HostTable every GPU of the host uses.

One process creates a named block (a file in ``/dev/shm``, a RAM-backed tmpfs), the others
open it by name; each maps it and pins its mapping in place (``cudaHostRegister``, as
:func:`xferlib.pin`), so each process's GPU gathers rows straight from the one copy. The
block starts with a header page holding the table's configuration (checked by every opener)
and the table's storage follows, page-aligned.

Lifetime: the creator unlinks the name once the others have opened it (or on ``close()``);
the memory then lives exactly as long as some process maps it and goes back to the OS with
the last one, even when processes die. ``close()`` unpins and unmaps at once.

Rows have owners: :func:`owner_of` (``row % world_size``) is the rank that applies the
optimizer to a row when several processes train one shared table (the torch adapter's
``process_group=``), so each row is written by exactly one process per step.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import weakref

import numpy as np

__all__ = ["SharedMemory", "owner_of", "shared_memory_directory"]

HEADER_BYTES = 4096  # one page: the storage after it stays page- and 16-byte aligned
_MAGIC = b"xferlib-shared/1\n"
_PREFIX = "xferlib-"


def owner_of(rows, world_size: int):
    """The rank owning each row: ``rows % world_size``. Row ``r`` of a table shared by
    ``world_size`` ranks is updated by rank ``r % world_size`` only, which sums every rank's
    gradient of that row in rank order before applying the optimizer once.

    >>> import numpy as np
    >>> owner_of(np.array([0, 1, 2, 3, 7]), 3).tolist()
    [0, 1, 2, 0, 1]
    """
    world_size = int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return rows % world_size


def shared_memory_directory() -> str:
    """Where shared blocks are made: ``$XFERLIB_SHM_DIR``, else ``/dev/shm`` (RAM-backed on
    Linux), else the temporary directory."""
    directory = os.environ.get("XFERLIB_SHM_DIR")
    if directory:
        return directory
    return "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_name(name) -> str:
    if not isinstance(name, str) or not name.startswith(_PREFIX) or "/" in name \
            or name in (".", "..") or len(name) > 200:
        raise ValueError(f"shared memory name must be a name made by SharedMemory.create "
                         f"(starting with {_PREFIX!r}, no '/'), got {name!r}")
    return name


class SharedMemory:
    """A named block of host memory several processes map, with a JSON header.

    ``SharedMemory.create(nbytes, header)`` makes one (``name`` is what others pass to
    ``SharedMemory.open(name)``); :meth:`array` views the storage as a NumPy array, pinned in
    place when a GPU is present. :meth:`unlink` removes the name (mappings stay valid);
    :meth:`close` unpins and unmaps.

    >>> import numpy as np
    >>> block = SharedMemory.create(4 * 6, {"what": "demo"}, pin=False)
    >>> a = block.array((2, 3), np.float32); a[...] = 7
    >>> other = SharedMemory.open(block.name, pin=False)
    >>> other.header["what"], float(other.array((2, 3), np.float32)[1, 2])
    ('demo', 7.0)
    >>> other.close(); block.unlink(); block.close()
    """

    def __init__(self, name, path, mapping, header, nbytes, owner, pin):
        self.name, self.path, self.header, self.nbytes = name, path, header, nbytes
        self._mapping = mapping
        self._owner = owner  # created this block: unlinks its name on close()
        self._pin = pin
        self._base = None  # the uint8 array over the storage (what is pinned)
        # A creator that forgets close() still removes the name when it is collected or
        # exits normally (a killed one leaves it: the name alone then holds the RAM).
        self._unlinker = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @classmethod
    def create(cls, nbytes: int, header: dict, *, directory=None, pin: bool = True):
        """A new zero-filled block of ``nbytes`` of storage. Its pages are reserved at once
        (``posix_fallocate``): a block the RAM disk cannot hold raises MemoryError here, not
        a bus error on first touch."""
        from xferlib.memory import format_bytes, check_host_memory

        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        directory = directory or shared_memory_directory()
        total = HEADER_BYTES + nbytes
        check_host_memory(total, f"a shared host table of {format_bytes(total)}")
        try:
            free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        except OSError:
            free = None
        if free is not None and total > free:
            raise MemoryError(f"a shared host table of {format_bytes(total)} does not fit in "
                              f"{directory} ({format_bytes(free)} free); enlarge it (e.g. "
                              f"docker --shm-size) or set XFERLIB_SHM_DIR to a larger tmpfs")
        text = json.dumps(header).encode()
        if len(_MAGIC) + 8 + len(text) > HEADER_BYTES:
            raise ValueError("shared memory header too large")
        name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as err:
                raise MemoryError(f"cannot reserve {format_bytes(total)} in {directory} for a "
                                  f"shared host table ({err.strerror}); enlarge it or set "
                                  f"XFERLIB_SHM_DIR") from None
            mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file
        mapping[:len(_MAGIC)] = _MAGIC
        mapping[len(_MAGIC):len(_MAGIC) + 8] = len(text).to_bytes(8, "little")
        mapping[len(_MAGIC) + 8:len(_MAGIC) + 8 + len(text)] = text
        return cls(name, path, mapping, dict(header), nbytes, True, pin)

    @classmethod
    def open(cls, name: str, *, directory=None, pin: bool = True):
        """The block ``name`` made by :meth:`create` in another process (same host)."""
        name = _check_name(name)
        path = os.path.join(directory or shared_memory_directory(), name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared memory {name!r} in {os.path.dirname(path)}: "
                                    f"its creator has not made it, or unlinked it already "
                                    f"(every process must open it before the creator "
                                    f"unlinks), or runs on another host") from None
        try:
            total = os.fstat(fd).st_size
            if total < HEADER_BYTES:
                raise ValueError(f"{path} is not an xferlib shared block ({total} bytes)")
            mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mapping[:len(_MAGIC)] != _MAGIC:
            mapping.close()
            raise ValueError(f"{path} is not an xferlib shared block")
        size = int.from_bytes(mapping[len(_MAGIC):len(_MAGIC) + 8], "little")
        header = json.loads(mapping[len(_MAGIC) + 8:len(_MAGIC) + 8 + size].decode())
        return cls(name, path, mapping, header, total - HEADER_BYTES, False, pin)

    @property
    def closed(self) -> bool:
        return self._mapping is None

    def array(self, shape, dtype) -> np.ndarray:
        """The storage as a C-contiguous array of ``shape`` and ``dtype`` (its size must be
        the block's), pinned in place when a GPU is present and ``pin`` was asked."""
        if self._mapping is None:
            raise ValueError(f"shared memory {self.name!r} is closed")
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if count != self.nbytes:
            raise ValueError(f"shared memory {self.name!r} holds {self.nbytes} bytes; shape "
                             f"{tuple(shape)} of {dtype} needs {count}")
        if self._base is None:
            base = np.frombuffer(self._mapping, np.uint8, self.nbytes, HEADER_BYTES)
            if self._pin and self.nbytes:
                from xferlib._backend import cupy_available
                from xferlib.memory import as_pinned

                # No host-memory check: the pages exist already (the creator reserved them);
                # pinning them takes no new RAM.
                if cupy_available():
                    base = as_pinned(base)
            self._base = base
        return self._base.view(dtype).reshape(shape)

    def unlink(self) -> None:
        """Remove the name: no process can open the block any more; mappings stay valid and
        the memory goes back to the OS when the last one is closed. Idempotent."""
        if self._unlinker is not None:
            self._unlinker()
        else:
            _unlink_quietly(self.path)

    def close(self) -> None:
        """Unpin and unmap (after the GPU is done with the pages), and unlink the name if
        this process created the block. Arrays from :meth:`array` must not be used after
        this; if some are still referenced the mapping goes when the last of them goes.
        Idempotent."""
        if self._owner:
            self.unlink()
        if self._mapping is None:
            return
        base, self._base = self._base, None
        if base is not None:
            from xferlib.memory import unpin

            unpin(base)  # waits for queued GPU work on the pages, then unregisters them
        del base
        mapping, self._mapping = self._mapping, None
        try:
            mapping.close()
        except BufferError:
            pass  # views are still referenced: the pages are unmapped when they go

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes"
        return f"SharedMemory({self.name!r}, {state})"
