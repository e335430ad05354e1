"""Any fsspec URL (``hdfs://``, ``gcs://`` through gcsfs, ``abfs://``, ``local://``, ...) through fsspec.

tensorstore cannot call into Python file systems, so arrays reach fsspec through a tensorstore *memory*
kvstore that acts as a per-save buffer:

* **save**: ``staging_root`` names a private memory area; the engine encodes and writes chunk files there
  with tensorstore exactly as for any other backend. :meth:`FsspecStorage.flush` (one per rank, after its
  writes, and once more by the coordinator after the metadata) uploads every buffered object with one
  batched ``fs.pipe`` and frees it. The commit marker is written last, straight through fsspec.
* **load**: packs (small arrays, small chunks) are read in ranged reads, the members a load needs merged into
  few spans (:meth:`FsspecStorage.ranged_reads`, :mod:`.ranged`; :meth:`FsspecStorage.read_suffix` for a
  pack's end): never downloaded whole. The first time the engine asks for the kvstore of an array stored
  in its own directory (``kvstore_spec(<root>/<tensor>)``), every stored object of that array is downloaded
  with one batched ``fs.cat`` into a memory area; the area is freed when the storage object is dropped (at
  the end of the load).

Trade-off: peak host memory of a rank grows by the encoded size of what it writes (save) or of the unpacked
arrays it reads from (load), and a load fetches such arrays whole even when the rank needs a slice of them.
Backends that tensorstore drives natively (local files, ``s3://``) avoid both and should be preferred; the
fsspec path is for file systems nothing else reaches (HDFS through pyarrow, vendor object stores).

A store that stops answering fails the save or load, naming the path: fsspec's calls have no timeout of
their own (s3fs waits 60 s per attempt and retries; a local or FUSE mount can block for ever), so each runs on
a thread of its own (:func:`~.retry.call_within`) and is waited for at most :meth:`~.base.Storage.stall_bound`
seconds (the save's or load's ``timeout=``), plus a second per MiB it moves (:data:`_MIN_BYTES_PER_SECOND`):
bulk transfers go in batches of at most :data:`_BATCH_BYTES` (64 MiB), so a stalled batch fails within the
stall bound and about a minute, as curl's low-speed watchdog (60 s) bounds a bulk transfer on ``s3://``. A
stalled bulk batch is not retried object by object (a store that stops answering would make that one stall
bound per object).

Commit is the marker strategy. The save lock is created with ``open(path, "xb")`` where the file system has
an exclusive create (local and memory; s3fs sends it as a ``PutObject`` with ``If-None-Match: *``: of
several saves one wins); elsewhere it is check-write-verify (best effort: two saves starting within one round
trip of each other may both proceed). It is no lease: fsspec has no conditional overwrite (``If-Match``) to
refresh it, so only the lock of a one-rank save whose process on this host is gone is taken over, by one
taker at a time: it holds a sentinel ``<final>/.acp-lock.takeover``, created the same exclusive way, while it
reads the lock again and replaces it (:meth:`~.claims.TargetClaims._replace_dead_lock`); a manager's cleanup
removes any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from ..checks.bounds import MAX_OBJECT_BYTES, load_json_bounded
from ..errors import CorruptCheckpointError, MetadataError, StorageError
from .base import LOCK_KEY, Storage, read_limit
from .httpread import is_http, read_range
from .retry import call_within, is_transient
from .stalls import StallTracker, refuse_if_stalled

log = logging.getLogger("arraycheckpoint")

_STAGING = "#acp-staging-"
#: the most bytes one batched upload (``fs.pipe``) or download (``fs.cat``) moves
_BATCH_BYTES = 64 << 20
#: the slowest rate a healthy store moves a bulk batch at: a call may take the stall bound plus a second per MiB
_MIN_BYTES_PER_SECOND = 1 << 20


class FsspecStorage(Storage):
    """One fsspec file system (``fsspec.filesystem(scheme, **options)``); marker commit."""

    commit_strategy = "marker"

    def __init__(self, scheme: str, options: dict[str, Any] | None = None) -> None:
        import fsspec

        options = dict(options or {})
        if scheme in ("local", "file"):
            options.setdefault("auto_mkdir", True)
        try:
            self.fs = fsspec.filesystem(scheme, **options)
        except (ImportError, ValueError) as e:
            raise StorageError(
                f"no storage backend for {scheme}:// URLs: fsspec says {e}; install the fsspec implementation "
                f"for {scheme!r} (e.g. s3fs, gcsfs, adlfs, pyarrow) or use a local path, memory:// or s3://"
            ) from e
        self.scheme = scheme
        self._id = uuid.uuid4().hex
        self._hydrated: set[str] = set()
        self._stalls: StallTracker | None = None  # the save this instance serves (:meth:`acquire`)
        weakref.finalize(self, _drop_memory, f"acp-fsspec/{self._id}/")

    # Paths -----------------------------------------------------------------------------------------
    def _strip(self, url: str) -> str:
        """The file system's own path for ``url`` (``fs._strip_protocol``, also for subclassed protocols; a
        file system whose paths are URLs, as HTTP's, keeps them)."""
        path = self.fs._strip_protocol(url)
        if path.startswith(f"{self.scheme}://") and not self._keeps_scheme:
            path = self.fs._strip_protocol(path[len(self.scheme) + 3 :])
        return path.rstrip("/")

    @property
    def _keeps_scheme(self) -> bool:
        """Whether the file system's paths are whole URLs (fsspec's HTTP file system, or one built on it:
        its ``_strip_protocol`` keeps the scheme by design, where another's only does not know it)."""
        return any(c.__module__ == "fsspec.implementations.http" for c in type(self.fs).__mro__)

    def normalize(self, url: str) -> str:
        path = self._strip(url)
        return path if path.startswith(f"{self.scheme}://") else f"{self.scheme}://{path}"

    def _rpath(self, root: str, key: str = "") -> str:
        path = self._strip(root)
        return f"{path}/{key}" if key else path

    def _split_staging(self, root: str) -> tuple[str, str, str] | None:
        """``(final, token, subpath)`` if ``root`` is (below) a staging root, else None."""
        if _STAGING not in root:
            return None
        final, _, rest = root.partition(_STAGING)
        token, _, sub = rest.partition("/")
        return final, token, sub.strip("/")

    def _memory_spec(self, area: str, sub: str) -> dict[str, Any]:
        path = f"acp-fsspec/{self._id}/{area}/"
        return {"driver": "memory", "path": path + (sub + "/" if sub else "")}

    def staging_root(self, final: str, token: str) -> str:
        return f"{final}{_STAGING}{token}"

    def kvstore_spec(self, root: str) -> dict[str, Any]:
        staged = self._split_staging(root)
        if staged is not None:
            _final, token, sub = staged
            return self._memory_spec(f"stage-{token}", sub)
        area = "read-" + hashlib.sha1(root.rstrip("/").encode()).hexdigest()[:20]
        if root not in self._hydrated:
            self._download(root, self._memory_spec(area, ""))
            self._hydrated.add(root)
        return self._memory_spec(area, "")

    def ranged_reads(self, root: str) -> Any:
        """Ranged reads of the objects below ``root`` (a checkpoint's packs), shaped as tensorstore's key-value
        store reads (:class:`~.ranged.FsspecRanges`): a load reads the members it needs, never a whole pack."""
        from .ranged import FsspecRanges

        return FsspecRanges(self, root)

    def read_suffix(self, root: str, key: str, want: int) -> tuple[bytes, int | None] | None:
        """The last ``want`` bytes of ``root/key`` (all of it when it is shorter) in one ranged read, and its
        size where that read tells it (the object was shorter than ``want``; else None: the caller finds it in
        the bytes, as a ZIP end record says it); None when the object is absent."""
        from .ranged import fetch

        got = fetch(self, self._rpath(root, key), -int(want), None)
        if got.state != "value":
            return None
        return got.value, (len(got.value) if len(got.value) != want else None)

    # Every call into the file system, bounded in time ------------------------------------------------------
    def _bounded(
        self, operation: str, path: str, fn: Any, nbytes: int = 0, seconds: float | None = None
    ) -> Any:
        """``fn()`` waited for at most the stall bound plus a second per MiB of ``nbytes`` (see the module
        docstring), or ``seconds`` when given (what is left of a ranged read's bound); a ``TimeoutError``
        naming ``operation`` and ``path`` when it does not return by then."""
        bound = self.stall_bound() + nbytes / _MIN_BYTES_PER_SECOND if seconds is None else seconds
        on_stall = self._stalls.stalled if self._stalls is not None else None
        return call_within(bound, fn, f"{operation} of {path}", on_stall)

    def _retry(self, operation: str, path: str, fn: Any, nbytes: int = 0) -> Any:
        return super()._retry(operation, path, lambda: self._bounded(operation, path, fn, nbytes))

    def _batch(self, operation: str, where: str, fn: Any, nbytes: int) -> Any:
        """One batched bulk call (:meth:`_bounded`); a stall is a :class:`StorageError` naming ``where`` at
        once (not retried object by object), any other error is raised as it is."""
        try:
            return self._bounded(operation, where, fn, nbytes)
        except TimeoutError as e:
            raise StorageError(f"storage {operation} of {where} failed: {e}") from e

    # Bulk transfer between the memory buffer and the file system -------------------------------------
    def _download(self, root: str, spec: dict[str, Any]) -> None:
        """Fetch every object below ``root`` into the memory area ``spec``: sizes checked before the bytes
        are fetched, batched ``cat`` calls of up to :data:`_BATCH_BYTES`, then per-object retries of only the
        objects that failed."""
        base = self._rpath(root)
        sizes = self._retry("list", root, lambda: self._find_sizes(base))
        if not sizes:
            return
        for path, size in sizes.items():
            _check_object_size(path, size)
        kv = _memory_kv(spec)
        prefix = base.rstrip("/") + "/"
        writes = []
        for batch in _batches(sizes):
            nbytes = sum(sizes[p] or _BATCH_BYTES for p in batch)
            where = f"{root} ({len(batch)} objects, {nbytes} bytes)"
            try:
                blobs = dict(
                    self._batch("read", where, lambda b=batch: self.fs.cat(b, on_error="return"), nbytes)
                )
            except StorageError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed batch: every object is fetched on its own below
                if not is_transient(e):
                    raise self._permanent("read", root, e) from e
                blobs = {}
            for path in batch:
                data = blobs.get(path)
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    data = self._retry(
                        "read", path, lambda p=path: _bounded_cat(self.fs, p), sizes[path] or _BATCH_BYTES
                    )
                _check_object_size(path, len(data))
                rel = self._strip(path)[len(prefix) :]
                writes.append(kv.write(rel, bytes(data)))
        for w in writes:
            w.result()

    def _find_sizes(self, base: str) -> dict[str, int | None]:
        """Every file below ``base`` (fsspec paths) with its listed size (None where the file system has none)."""
        self._forget(base)
        try:
            if not self.fs.exists(base):
                return {}
            found = self.fs.find(base, detail=True)
        finally:  # nor is this listing left for another reader of the process to trust later
            self._forget(base)
        for p, info in found.items():
            # file systems with links (local://, sftp, hdfs): only regular files are read, links never followed
            if isinstance(info, dict) and (info.get("islink") or info.get("type", "file") != "file"):
                kind = "a symlink" if info.get("islink") else f"not a regular file ({info.get('type')})"
                raise CorruptCheckpointError(
                    f"{p} is {kind}; a checkpoint holds only regular files and nothing is read through a link"
                )
        return {
            p: (info.get("size") if isinstance(info, dict) else None) for p, info in sorted(found.items())
        }

    def _forget(self, path: str) -> None:
        """Drop what the file system cached about ``path``, its parents and everything below it. Other jobs
        write and delete here; a cached listing (s3fs and gcsfs keep them for the life of the process) hid a
        step committed since from ``latest_step()``, or showed one deleted since."""
        try:
            self.fs.invalidate_cache(path)
            cache = getattr(self.fs, "dircache", None)
            if cache:
                below = path.rstrip("/") + "/"
                for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(below)]:
                    cache.pop(key, None)
        except Exception:  # noqa: BLE001 - a file system without a cache, or one that cannot drop it
            pass

    def list_sizes(self, root: str) -> dict[str, int | None]:
        """Every object below ``root``: relative key -> size (one listing; for the load-time checks)."""
        base = self._rpath(root)
        prefix = base.rstrip("/") + "/"
        sizes = self._retry("list", root, lambda: self._find_sizes(base))
        return {self._strip(p)[len(prefix) :]: n for p, n in sizes.items()}

    def _permanent(self, operation: str, path: str, e: BaseException) -> StorageError:
        return StorageError(f"storage {operation} of {path} failed (permanent error, not retried): {e}")

    def flush(self, root: str) -> None:
        """Upload everything this rank buffered for ``root`` (a staging root) and free the buffer."""
        staged = self._split_staging(root)
        if staged is None:
            return
        final, token, sub = staged
        kv = _memory_kv(self._memory_spec(f"stage-{token}", sub))
        target = self.join(final, sub) if sub else final
        batch: dict[str, bytes] = {}
        uploaded: list[str] = []
        size = 0
        for key in [k.decode() for k in kv.list().result()]:
            data = bytes(kv.read(key).result().value)
            batch[self._rpath(target, key)] = data
            uploaded.append(key)
            size += len(data)
            if size >= _BATCH_BYTES:
                self._upload(final, batch)
                for done in uploaded:  # free each batch once it is stored: peak stays ~one batch above
                    kv.write(done, None).result()
                batch, uploaded, size = {}, [], 0
        if batch:
            self._upload(final, batch)
            for done in uploaded:
                kv.write(done, None).result()

    def _upload(self, final: str, batch: dict[str, bytes]) -> None:
        """One batched ``pipe``; if it fails transiently, each object is uploaded (and retried) on its own.

        Retrying the whole batch would need every one of its objects to succeed in one attempt: with a few
        percent of requests failing, a batch of hundreds of objects practically never does. Overwriting an
        object that the failed batch already stored is harmless (same bytes).
        """
        nbytes = sum(len(d) for d in batch.values())
        where = f"{final} ({len(batch)} objects, {nbytes} bytes)"
        try:
            self._batch("upload", where, lambda: self.fs.pipe(batch), nbytes)
            return
        except StorageError:  # the store stalls
            raise
        except Exception as e:  # noqa: BLE001 - classified: permanent fails now, transient goes per object
            if not is_transient(e):
                raise self._permanent("upload", where, e) from e
        for path, data in batch.items():
            self._retry("upload", path, lambda p=path, d=data: self.fs.pipe_file(p, d), len(data))

    # A save's requests that timed out but still run (:mod:`.stalls`) -----------------------------------
    def acquire(self, final: str, token: str) -> None:
        refuse_if_stalled(final, token)
        self._stalls = StallTracker(final, token)
        try:
            super().acquire(final, token)
        except BaseException:
            # a lock create that timed out may land after this save failed: it is removed when it ends
            self._stalls.defer(lambda: self.release(final, token))
            raise

    def open_flush(self, root: str) -> None:
        staged = self._split_staging(root)
        if staged is not None:  # every rank: an earlier save's stalled upload of this process may land here
            refuse_if_stalled(staged[0], staged[1])
        if self._stalls is None and staged is not None:
            self._stalls = StallTracker(staged[0], staged[1])  # a rank other than the coordinator

    def stalled(self) -> str | None:
        return self._stalls.alive() if self._stalls is not None else None

    def release(self, final: str, token: str) -> None:
        if self._stalls is not None and self._stalls.defer(lambda: self.release(final, token)):
            return  # kept until this save's stalled requests end (they may still land)
        super().release(final, token)

    def commit(self, staging: str, final: str, overwrite: bool) -> None:
        self.flush(staging)  # anything the coordinator wrote after its last flush
        self._write_marker(final)

    def abort(self, staging: str, final: str) -> None:
        if self._stalls is not None and self._stalls.defer(lambda: self.abort(staging, final)):
            log.warning(
                "abort of %s waits: a request of this save timed out and may still land; what it stored is "
                "deleted once it ends, and the save's lock is kept until then", final,
            )  # fmt: skip
            return
        staged = self._split_staging(staging)
        if staged is not None:
            _drop_memory(self._memory_spec(f"stage-{staged[1]}", "")["path"])
        super().abort(final, final)
        self._prune_empty_dirs(final)

    def _prune_empty_dirs(self, root: str) -> None:
        """Remove the directories an aborted save left empty (file systems with real directories), deepest
        first, so the next save's target check does not take them for the user's (best effort, each call
        bounded: a stalled store does not hold the abort)."""
        base = self._rpath(root)
        try:
            found = self._bounded("list", base, lambda: self.fs.find(base, withdirs=True, detail=True))
            dirs = [
                p for p, info in found.items() if isinstance(info, dict) and info.get("type") == "directory"
            ]
            for path in sorted(dirs, key=len, reverse=True):
                try:
                    self._bounded("delete", path, lambda p=path: self.fs.rmdir(p))
                except TimeoutError:
                    return
                except Exception:  # noqa: BLE001 - not empty (the lock's directory) or no directories at all
                    pass
        except Exception:  # noqa: BLE001 - cleanup must not mask the save's own error
            pass

    # Small objects straight through fsspec (staging roots: the memory buffer) ---------------------------
    def read(self, root: str, key: str, limit: int | None = None) -> bytes | None:
        if self._split_staging(root):
            return super().read(root, key, limit)
        path = self._rpath(root, key)
        bound = read_limit(limit)

        def op() -> bytes | None:
            try:
                return _bounded_cat(self.fs, path, bound)
            except FileNotFoundError:
                return None

        return self._retry("read", path, op)

    def write(self, root: str, key: str, data: bytes) -> None:
        if self._split_staging(root):
            return super().write(root, key, data)
        path = self._rpath(root, key)
        self._retry("write", path, lambda: self.fs.pipe_file(path, data), len(data))

    def exists(self, root: str, key: str) -> bool:
        path = self._rpath(root, key)

        def op() -> bool:
            self._forget(path)
            return bool(self.fs.isfile(path))

        return bool(self._retry("exists", path, op))

    def list(self, root: str) -> list[str]:
        if self._split_staging(root):
            return super().list(root)
        base = self._rpath(root)

        def op() -> list[str]:
            self._forget(base)
            if not self.fs.exists(base):
                return []
            prefix = base.rstrip("/") + "/"
            return sorted(self._strip(p)[len(prefix) :] for p in self.fs.find(base))

        return self._retry("list", base, op)

    def sample(self, root: str, limit: int) -> list[str]:
        """Up to ``limit`` entries of ``root``'s top level (directories as ``name/``): one ``ls``, a single
        delimited listing on object stores, never a walk of the whole tree."""
        base = self._rpath(root)

        def op() -> list[str]:
            self._forget(base)
            if not self.fs.isdir(base):
                return ["(a file at this path, not a directory)"] if self.fs.isfile(base) else []
            entries = self.fs.ls(base, detail=True)
            names = [
                self._strip(e["name"]).rsplit("/", 1)[-1] + ("/" if e.get("type") == "directory" else "")
                for e in entries
            ]
            return sorted(names)[:limit]

        return self._retry("list", base, op)

    def children(self, root: str) -> list[str]:
        base = self._rpath(root)

        def op() -> list[str]:
            self._forget(base)
            try:
                if not self.fs.isdir(base):
                    return []
                return sorted(self._strip(p).rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
            finally:  # nor is this listing left for another reader of the process to trust later
                self._forget(base)

        return self._retry("list", base, op)

    def delete(self, root: str) -> None:
        base = self._rpath(root)

        def op() -> None:
            self._forget(base)
            if self.fs.exists(base):
                self.fs.rm(base, recursive=True)

        self._retry("delete", base, op)

    def delete_key(self, root: str, key: str, guard: Callable[[], None] | None = None) -> None:
        path = self._rpath(root, key)

        def op() -> None:
            if guard is not None:
                guard()  # a lease check before each attempt (see Storage.delete_key)
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._retry("delete", path, op)

    def _create_lock(self, final: str, body: bytes) -> bool:
        return self._create_key(final, LOCK_KEY, body)  # no lease (see TargetClaims._leases)

    def _create_key(self, final: str, key: str, body: bytes) -> bool:
        # an exclusive create where the file system has one (local, memory: mode "xb"): a look, then a write,
        # let two saves that looked at once both write and both read their own lock back
        path = self._rpath(final, key)
        for _attempt in range(2):
            try:
                with self.fs.open(path, "xb") as f:
                    f.write(body)
                return True
            except FileExistsError:
                return False
            except FileNotFoundError:  # its directory is not there yet
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            except (ValueError, NotImplementedError, TypeError, OSError):  # no exclusive create here
                break
        if self.exists(final, key):
            return False
        self.write(final, key, body)
        stored = self.read(final, key) or b"{}"
        return load_json_bounded(stored, max_bytes=1 << 16, what=f"{final}/{key}") == json.loads(body)


def _batches(sizes: dict[str, int | None]) -> list[list[str]]:
    """The paths of ``sizes`` in batches of at most :data:`_BATCH_BYTES` (an object larger alone; an unknown
    size, which few file systems leave, counted as a whole batch)."""
    out: list[list[str]] = []
    held = _BATCH_BYTES
    for path, size in sizes.items():
        n = _BATCH_BYTES if size is None else size
        if not out or held + n > _BATCH_BYTES:
            out.append([])
            held = 0
        out[-1].append(path)
        held += n
    return out


def _bounded_cat(fs: Any, path: str, limit: int = MAX_OBJECT_BYTES) -> bytes:
    """The bytes of ``path``, refusing (without fetching more than ``limit + 1`` bytes) a larger object."""
    if is_http(fs):  # a server may send the whole object, whatever was asked: streamed, cut at the limit
        data = read_range(fs, path, 0, limit + 1, limit + 1)
    else:
        data = bytes(fs.cat_file(path, start=0, end=limit + 1))
    if len(data) > limit:
        raise MetadataError(
            f"{path} is larger than {limit} bytes, more than a valid checkpoint stores in one object; the "
            "checkpoint is damaged or hostile"
        )
    return data


def _check_object_size(path: str, size: int | None) -> None:
    if size is not None and size > MAX_OBJECT_BYTES:
        raise CorruptCheckpointError(
            f"{path} is {size} bytes, more than any chunk a valid checkpoint stores ({MAX_OBJECT_BYTES}); "
            "refused before downloading it"
        )


def _memory_kv(spec: dict[str, Any]) -> Any:
    import tensorstore as ts

    from ..runtime.tscontext import context

    return ts.KvStore.open(spec, context=context()).result()


def _drop_memory(path: str) -> None:
    """Free the memory-kvstore area ``path`` (called when a storage object is collected)."""
    try:
        import tensorstore as ts

        _memory_kv({"driver": "memory", "path": path}).delete_range(ts.KvStore.KeyRange()).result()
    except Exception:  # noqa: BLE001 - interpreter shutdown or already gone
        pass
