"""The file checks every reader of untrusted input makes on a local file system, in one place.

A checkpoint (ours, a Hugging Face directory, a DCP directory) is input that others write (DESIGN invariant
10). Before any byte of one of its files is read, the file is opened so that nothing is followed or waited
on, and its size is known before anything is sized from it:

* :func:`open_below`: ``root/key`` opened one path component at a time below ``root`` with ``O_NOFOLLOW``
  (``root`` itself may be a link: ``latest -> step_100``), the last one with ``O_NONBLOCK`` (a FIFO is
  opened at once, never waited on);
* :func:`open_regular`: the same, and the file must be a regular file (a FIFO, socket or device is refused)
  of at most ``limit`` bytes: returns the descriptor and the size;
* :func:`read_below`: a whole regular file of at most ``limit`` bytes;
* :func:`pread_exact`: exactly ``n`` bytes at an offset of an open file, or a clear error naming it.

The native load (:mod:`arraycheckpoint.storage.local`, :mod:`arraycheckpoint.checks`), the sources
(:mod:`arraycheckpoint.sources`) and the tools use these, so a link or a FIFO gets the same answer at every
entry point: :class:`~arraycheckpoint.errors.CorruptCheckpointError` naming the path. What this module does
not do: stop a writer that swaps a file for a link between this check and a later open by tensorstore
(docs/security.md, "Race the reader").
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from ..errors import CorruptCheckpointError, StorageError

__all__ = ["open_below", "open_directory", "open_regular", "open_regular_at", "pread_exact", "read_below"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _check_key(root: str, key: str) -> list[str]:
    """The components of ``key``: relative, no ``..``, no empty component, no NUL."""
    parts = key.split("/")
    if "\0" in key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpointError(
            f"{os.path.join(root, key.replace(chr(0), '<NUL>'))!r}: the name {key!r} is not a plain path "
            "below the checkpoint (absolute, '..', empty or with a NUL byte); nothing outside a checkpoint is "
            "read"
        )
    return parts


def _open_component(fd: int, part: str, last: bool, where: Callable[[], str], full: str) -> int | None:
    """``part`` opened relative to the directory ``fd`` with ``O_NOFOLLOW`` (a directory on the way, or
    non-blocking when ``last``); None when absent. ``where()``: its path, ``full``: the whole path (errors)."""
    flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
    try:
        return os.open(part, flags, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise StorageError(f"storage read of {full} failed: {e}") from e
        if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
            raise CorruptCheckpointError(
                f"{where()} is a symlink; nothing in a checkpoint is read through a link (replace it "
                "with the file itself, or re-save the checkpoint)"
            ) from None
        raise CorruptCheckpointError(
            f"{where()} is not a directory; the checkpoint is damaged (a checkpoint holds only regular "
            "files and directories)"
        ) from None


def open_below(root: str, key: str) -> int | None:
    """A descriptor of ``root/key``, opened component by component below ``root`` with ``O_NOFOLLOW``
    (``root`` itself may be a link), so neither the file nor a directory on the way (``.acp``) can be a
    symlink; the file is opened non-blocking (a FIFO does not hang). None when something on the way is absent.

    Raises:
        CorruptCheckpointError: a component below ``root`` is a symlink, or a non-directory on the way, or
            ``key`` is not a plain relative name.
        StorageError: any other failure, naming the path.
    """
    parts = _check_key(root, key)
    full = os.path.join(root, key)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise StorageError(f"storage read of {full} failed: {e}") from e
    try:
        for i, part in enumerate(parts):
            child = _open_component(
                fd, part, i == len(parts) - 1, lambda i=i: os.path.join(root, *parts[: i + 1]), full
            )
            if child is None:
                return None
            os.close(fd)
            fd = child
        child, fd = fd, -1
        return child
    finally:
        if fd >= 0:
            os.close(fd)


def open_regular(root: str, key: str, *, limit: int | None = None, what: str = "") -> tuple[int, int] | None:
    """``(descriptor, size)`` of the regular file ``root/key`` (see :func:`open_below`), None when absent.

    Args:
        root: the directory of the checkpoint (may be a link).
        key: the file's ``/``-separated name below ``root``.
        limit: refuse a file larger than this many bytes.
        what: what the file is, for the errors (e.g. ``"tensor 'model/w': "``).

    Raises:
        CorruptCheckpointError: a link, a FIFO, socket, device or directory, or a file above ``limit``.
    """
    return _regular(lambda: open_below(root, key), os.path.join(root, key), limit, what)


def open_regular_at(dir_fd: int, name: str, path: str, *, what: str = "") -> tuple[int, int] | None:
    """:func:`open_regular` of the file ``name`` in the directory open as ``dir_fd`` (``path``: its path, for
    the errors): one ``openat`` (``O_NOFOLLOW``, non-blocking) and one ``fstat``, not a walk from the root.
    A reader opening many files of one directory (a load's packs) opens the directory once this way; the
    directory it reads is the one it opened, whatever is renamed over its path since."""
    if "/" in name or name in ("", ".", ".."):
        raise CorruptCheckpointError(f"{what}{path}: {name!r} is not a plain file name")
    return _regular(lambda: _open_component(dir_fd, name, True, lambda: path, path), path, None, what)


def open_directory(root: str, key: str) -> int | None:
    """A descriptor of the directory ``root/key`` (see :func:`open_below`), None when absent.

    Raises:
        CorruptCheckpointError: a link on the way, or ``root/key`` is not a directory.
    """
    fd = open_below(root, key)
    if fd is None:
        return None
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(
            f"{os.path.join(root, key)} is not a directory; the checkpoint is damaged (a checkpoint holds only "
            "regular files and directories)"
        )
    return fd


def _regular(
    opener: Callable[[], int | None], path: str, limit: int | None, what: str
) -> tuple[int, int] | None:
    """``(fd, size)`` of what ``opener()`` opens (None: absent) once it is known to be a regular file of at
    most ``limit`` bytes (else closed and refused); ``what`` prefixes the errors."""
    try:
        fd = opener()
    except CorruptCheckpointError as e:
        if not what:
            raise
        raise CorruptCheckpointError(f"{what}{e}") from None
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{what}{path} is not a regular file (a FIFO, socket, device or directory); a checkpoint holds "
                "only regular files, and nothing is opened that could block a reader"
            )
        if limit is not None and st.st_size > limit:
            raise CorruptCheckpointError(
                f"{what}{path} is {st.st_size} bytes, above the limit of {limit} for this file; the checkpoint "
                "is damaged or hostile"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_below(root: str, key: str, limit: int, what: str = "") -> bytes | None:
    """The bytes of the regular file ``root/key`` of at most ``limit`` bytes (:func:`open_regular`), None
    when absent."""
    opened = open_regular(root, key, limit=limit, what=what)
    if opened is None:
        return None
    fd, size = opened
    try:
        return pread_exact(fd, 0, size, os.path.join(root, key), what)
    finally:
        os.close(fd)


def pread_exact(fd: int, offset: int, n: int, path: str, what: str = "") -> bytes:
    """Exactly ``n`` bytes of the open file ``fd`` from ``offset``.

    Raises:
        CorruptCheckpointError: the file ends before (it is truncated, or shrank), naming ``path``.
    """
    parts = []
    done = 0
    while done < n:
        chunk = os.pread(fd, min(n - done, 1 << 26), offset + done)
        if not chunk:
            raise CorruptCheckpointError(
                f"{what}{path} ends at byte {offset + done}, before the {n} bytes at {offset} it must hold; the "
                "file is truncated"
            )
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)
