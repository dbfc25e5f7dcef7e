"""Crash-safe file writes: a crash leaves the old file or the new one, never a torn one.

:func:`atomic_write` is the one way xferlib replaces a file, public so that a training script
writes its own checkpoints the same way::

    import json, xferlib
    xferlib.atomic_write("meta.json", lambda f: f.write(json.dumps({"step": 12}).encode()))

The steps (POSIX's recipe; see ``rename(2)`` and ``fsync(2)``):

1. the data goes to a new temporary file in the target's own directory (a rename is atomic
   only within one file system);
2. the file is flushed and ``fsync``-ed, so its bytes are on the disk before its name is;
3. ``os.replace`` renames it over the target: readers see the old file or the new one;
4. the directory is ``fsync``-ed, so the rename itself survives a power cut.

The target must be a regular file or absent: a device, FIFO, socket or directory is refused
and never renamed over (a rename would put a regular file in place of ``/dev/full``). The new
file gets the permissions ``open(path, "w")`` would give: a new file ``0o666`` less the umask
(and any default ACL), an existing one its mode and, where allowed, its owner. Every error
names the path the caller gave, never the temporary file. A process killed mid-write leaves
its temporary file (``.xferlib-<pid>-<random>.tmp`` beside the target), which any later
process may delete; the target is untouched.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

__all__ = ["atomic_write", "TEMPORARY_PREFIX"]

TEMPORARY_PREFIX = ".xferlib-"  # the temporary files' names: .xferlib-<pid>-<hex>.tmp

_NOT_REGULAR = ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"))


def atomic_write(path, write, *, what: str = "the file") -> None:
    """Write ``path`` crash-safely: ``write(f)`` fills ``f``, a binary file object open on a
    new temporary file in ``path``'s directory (``f.fileno()`` for raw ``os.write``; ``f``
    is seekable); then the file is flushed, synced and renamed over ``path``, and the
    directory synced. If ``write`` raises, the temporary file is removed, ``path`` is left
    as it was and the exception propagates. ``what`` names the data in error messages
    (``"cannot save the collection to ..."``).

    ``path`` may be a symlink (its target is replaced, as ``open(path, "w")`` writes it).
    ValueError for a device, FIFO or socket; IsADirectoryError for a directory (or any
    path ending in a slash);
    FileNotFoundError naming the directory when it does not exist.

    >>> import os, tempfile, xferlib
    >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
    >>> xferlib.atomic_write(path, lambda f: f.write(b"saved"))
    >>> open(path, "rb").read()
    b'saved'
    """
    path = os.fsdecode(path)  # str, bytes or a path object, as open() takes
    if path.endswith(os.sep):  # "x/" names a directory: open(path, "w") refuses it
        if os.path.exists(path.rstrip(os.sep)) and not os.path.isdir(path.rstrip(os.sep)):
            raise NotADirectoryError(20, f"cannot save {what} to {path}: not a directory",
                                     path)
        # realpath() drops the slash: a missing "x/" would become a new file named "x"
        raise IsADirectoryError(errno.EISDIR, f"cannot save {what} to {path}: it names a "
                                f"directory (give a file name inside it)", path)
    target = os.path.realpath(path)  # through a symlink, as open(path, "w") writes
    directory = os.path.dirname(target)
    try:
        existing = _check_target(path, target, what)
        fd, tmp = _create_temporary(directory, existing)
    except FileNotFoundError as err:
        shown = directory  # the symlink's target's directory, where the file would go
        raise FileNotFoundError(err.errno, f"cannot save {what} to {path}: the directory "
                                f"{shown} does not exist", path) from None
    except OSError as err:
        raise _naming(err, path, what) from None
    try:
        with open(fd, "wb") as f:  # closes fd, also when write() raises
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _check_target(path, target, what)  # again: the path may have changed meanwhile
        os.replace(tmp, target)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(err, OSError):
            raise _naming(err, path, what) from err
        raise
    _sync_directory(directory, path, what)


def _check_target(path: str, target: str, what: str):
    """The target's stat if it is a regular file, None if it does not exist; refuses any
    other kind (``os.replace`` would put a regular file in place of a device or FIFO)."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return st
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"cannot save {what} to {path}: it is a "
                                f"directory (give a file name inside it)", path)
    kind = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "special file")
    raise ValueError(f"cannot save {what} to {path}: it is a {kind}, not a regular file; a "
                     f"save replaces a regular file or makes a new one, and never replaces a "
                     f"device, FIFO, socket or directory")


def _create_temporary(directory: str, existing):
    """``(fd, name)`` of a new file in ``directory``, created with mode ``0o666`` so the
    kernel applies the umask (and a default ACL) as for ``open(path, "w")``; an existing
    target's mode and owner carry over, as that open would keep them."""
    for _ in range(100):
        name = os.path.join(directory, f"{TEMPORARY_PREFIX}{os.getpid()}-"
                                       f"{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        if existing is not None:
            try:
                os.fchmod(fd, stat.S_IMODE(existing.st_mode))
                if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
                    os.fchown(fd, existing.st_uid, existing.st_gid)
            except PermissionError:
                pass  # only root may give a file away; the mode is set by then
            except BaseException:
                os.close(fd)
                os.unlink(name)
                raise
        return fd, name
    raise FileExistsError(errno.EEXIST, f"no free temporary file name in {directory}")


def _sync_directory(directory: str, path: str, what: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a directory we may write but not open (mode -wx): nothing more to do
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # fs without it
            raise _naming(err, path, what) from None
    finally:
        os.close(fd)


def _naming(err: OSError, path: str, what: str) -> OSError:
    """``err`` with a message that names ``path`` (a temporary file's name means nothing to
    the caller)."""
    if (err.strerror or "").startswith("cannot save"):  # ours, already naming it
        return err
    reason = err.strerror or str(err)
    if err.errno is None:
        return type(err)(f"cannot save {what} to {path}: {reason}")
    return type(err)(err.errno, f"cannot save {what} to {path}: {reason}", path)
