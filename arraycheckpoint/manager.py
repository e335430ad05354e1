"""The checkpoint manager: one directory per training step, a queue of asynchronous saves, retention, and
cleanup of what crashed runs left behind.

Its one job is *steps*: naming, listing, choosing what to keep. Atomicity and threads belong to the engine
(:func:`arraycheckpoint.save_async`) and the storage backends' commit strategies; the manager never writes
checkpoint bytes itself.

Layout under ``root`` (any storage URL)::

    root/step_00000100/    one committed checkpoint per step (``.acp/committed`` inside)
    root/step_00000200/
    root/.acp-staging-<token>/   (local file systems: a save in flight or a crashed one; no name of ours
                                 beside the steps holds a step's name: storage/localnames.py)

Rules:

* A new save starts only after the previous one committed (``if_busy="wait"``, default) or is skipped when
  the previous one is still running (``if_busy="skip"``; the decision is agreed by all ranks). Saves never
  interleave.
* Retention runs on the coordinator after each successful commit: the newest ``keep_last`` committed steps
  are kept, every step divisible by ``keep_every`` is kept, and the newest committed step is never deleted,
  nor the step just committed (kept until the next save's pass when it is older than the kept ones).
  A deleted step disappears at once (renamed aside on POSIX; marker removed first on object stores). A step
  that a load in this process is reading is kept until a later pass; a step removed from under a reader
  (by another job) makes that load raise ``CheckpointNotFoundError``.
* On start (``cleanup=True``) the coordinator removes staging directories, stale locks, half-deleted steps
  and step directories without a commit marker that hold only what a save writes (one holding anything
  else is kept, with a warning); the other ranks wait for it. On a local or network file system a save in flight of another
  job (its lock's ``flock`` is held) is left alone, and so is one on an object store (its lock's lease is
  live); fsspec URLs cannot tell (no lease): run one job per root there.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import stat
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ._validate import check_timeout
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .runtime.future import CheckpointFuture
from .storage import storage_for
from .storage.base import being_read, is_checkpoint_key

log = logging.getLogger("arraycheckpoint")

_IF_BUSY = ("wait", "skip")


class ManagedSave:
    """Handle of one save started by :meth:`CheckpointManager.save`.

    ``staged`` completes when the snapshot is taken; :meth:`result` returns the committed metadata (None on
    non-coordinator ranks) after the commit and the retention pass, or raises the save's error.
    """

    def __init__(self, step: int, path: str, future: CheckpointFuture, done: Future[Any]) -> None:
        self.step = step
        self.path = path
        self.future = future
        self._done = done

    @property
    def staged(self) -> Future[None]:
        return self.future.staged

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the commit (and retention); raise the save's error if it failed."""
        return self._done.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._done.exception(timeout)

    def done(self) -> bool:
        return self._done.done()

    def __repr__(self) -> str:
        return f"ManagedSave(step={self.step}, {'done' if self.done() else 'pending'})"


class CheckpointManager:
    """Steps, retention and crash cleanup over one checkpoint root.

    Args:
        root: directory or URL holding one sub-directory per step (any URL :func:`storage_for` accepts).
        keep_last: keep the newest ``keep_last`` committed steps (None keeps every step). Must be >= 1.
        keep_every: also keep every step divisible by ``keep_every`` (None: no such exemption).
        if_busy: ``"wait"`` (a save waits for the previous commit) or ``"skip"`` (a save requested while the
            previous one runs is skipped on every rank and :meth:`save` returns None).
        cleanup: remove uncommitted leftovers under ``root`` when the manager starts (coordinator only).
        step_prefix: directory name prefix; step directories are ``<prefix><step:08d>``.
        save_options: default keyword arguments of :func:`arraycheckpoint.save_async` (``framework``,
            ``compression``, ``comm``, ...).
        load_options: default keyword arguments of :func:`arraycheckpoint.load`.

    Create it on every rank at the same point (its construction is collective under torch.distributed).

    Example:
        >>> mgr = CheckpointManager("s3://bucket/run1", keep_last=3, keep_every=1000)
        >>> start = mgr.latest_step()
        >>> if start is not None:
        ...     mgr.restore(state={"model": model, "optimizer": opt})
        >>> for step in range(start or 0, steps):
        ...     train_step()
        ...     if step % 100 == 0:
        ...         mgr.save(step, {"model": model, "optimizer": opt})
        >>> mgr.close()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        if_busy: str = "wait",
        cleanup: bool = True,
        step_prefix: str = "step_",
        save_options: Mapping[str, Any] | None = None,
        load_options: Mapping[str, Any] | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        if if_busy not in _IF_BUSY:
            raise ValueError(f"if_busy must be one of {_IF_BUSY}, got {if_busy!r}")
        if not re.fullmatch(r"[A-Za-z0-9_\-]*", step_prefix):
            raise ValueError(f"step_prefix {step_prefix!r} may only hold letters, digits, '_' and '-'")
        url = os.fspath(root)
        self.storage, self.root = storage_for(url)
        # Saves and loads get URLs in the caller's scheme (a registered scheme may wrap a built-in backend).
        self._url = url.rstrip("/") if "://" in url else self.root
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.if_busy = if_busy
        self.step_prefix = step_prefix
        self.save_options = dict(save_options or {})
        self.load_options = dict(load_options or {})
        self._step_re = re.compile(re.escape(step_prefix) + r"([0-9]+)", re.ASCII)
        # listings, retention and cleanup are bounded as the saves are (a store that stops answering)
        self.storage.stall_timeout = check_timeout(self.save_options.get("timeout"))
        if self._root_committed(url):  # every rank, before anything collective: all raise alike
            raise ValueError(
                f"{url} is itself a committed checkpoint, not a directory of steps: pass the directory holding "
                f"the steps (its parent, {self.storage.parent(self.root)[0]}), or load it with acp.load(path, "
                "state); steps saved here would nest inside it (and go with it when it is replaced)"
            )
        self._sync = _RankSync(self.save_options.get("comm"))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acp-manager")
        self._pending: ManagedSave | None = None
        self._lock = threading.Lock()
        self.removed: list[str] = []
        if cleanup:
            if self._sync.rank == 0:
                self.removed = self.cleanup()
            self._sync.barrier()

    # Steps -----------------------------------------------------------------------------------------------
    def step_path(self, step: int) -> str:
        """The checkpoint path or URL of ``step`` (what :func:`arraycheckpoint.load` takes)."""
        return self._step_url(step)

    def _step_name(self, step: int) -> str:
        return f"{self.step_prefix}{_as_step(step):08d}"

    def _step_url(self, step: int) -> str:
        name = self._step_name(step)
        return f"{self._url}/{name}" if "://" in self._url else os.path.join(self._url, name)

    def _step_root(self, step: int) -> str:
        return self.storage.join(self.root, self._step_name(step))

    def _step_dirs(self) -> dict[int, str]:
        """Step -> checkpoint root of every child named exactly as this manager names a step (ASCII digits,
        ``<prefix><step:08d>``: ``step_٩٩`` is no step 99) that is a directory (on a local file system a
        FIFO, file or symlink of that name is skipped, never opened, deleted or followed)."""
        out = {}
        for name in self.storage.children(self.root):
            m = self._step_re.fullmatch(name)
            if m and self._step_name(int(m.group(1))) == name and self._is_step_dir(name):
                out[int(m.group(1))] = self.storage.join(self.root, name)
        return out

    def _is_step_dir(self, name: str) -> bool:
        from .storage import LocalStorage

        if not isinstance(self.storage, LocalStorage):
            return True  # object stores: a step is a prefix (nothing there can be a FIFO or a link)
        try:
            return stat.S_ISDIR(os.lstat(os.path.join(self.root, name)).st_mode)
        except FileNotFoundError:
            return False

    def _committed(self, path: str) -> bool | None:
        """Whether the step directory ``path`` is committed; None when its commit marker cannot be read as
        one (a FIFO, a link on the way: ``.acp`` a symlink) or this process may not look (a directory of
        another user's, mode 000): such a step is damaged or not ours, neither listed nor deleted (a warning
        names it), so one such step stops neither a resume nor retention."""
        try:
            return self.storage.is_committed(path)
        except CorruptCheckpointError as e:
            log.warning("skipping step directory %s: its commit marker is damaged (%s); it is kept", path, e)
            return None
        except StorageError as e:
            if not isinstance(e.__cause__, PermissionError):
                raise
            log.warning(
                "skipping step directory %s: this process may not read it (%s); it is neither listed nor "
                "deleted", path, e.__cause__,
            )  # fmt: skip
            return None

    def _root_committed(self, url: str) -> bool | None:
        """Whether the root itself is a committed checkpoint (:meth:`_committed`); a root this process may
        not read is an error naming it (its steps could be neither listed nor kept apart from the rest)."""
        try:
            return self.storage.is_committed(self.root)
        except CorruptCheckpointError:
            return None
        except StorageError as e:
            if not isinstance(e.__cause__, PermissionError):
                raise
            raise StorageError(
                f"{url}: this process may not read the checkpoint root ({e.__cause__}); the manager lists, "
                "saves and removes steps there: give it read, write and search permission"
            ) from e

    def all_steps(self) -> list[int]:
        """Every step with a committed checkpoint, ascending (a step whose marker is damaged is skipped)."""
        return sorted(s for s, path in self._step_dirs().items() if self._committed(path))

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # Save ------------------------------------------------------------------------------------------------
    def save(
        self, step: int, state: Mapping[str, Any], *, if_busy: str | None = None, **save_options: Any
    ) -> ManagedSave | None:
        """Start saving ``state`` as ``step``; returns once the snapshot is taken (call on every rank).

        Args:
            step: the training step (directory ``<prefix><step:08d>``).
            state: as for :func:`arraycheckpoint.save_async`.
            if_busy: overrides the manager's policy for this call.
            save_options: override the manager's ``save_options`` for this call.

        Returns:
            A :class:`ManagedSave`, or None when the save was skipped by the ``"skip"`` policy.

        Raises:
            CheckpointExistsError: (from ``result()``) ``step`` is already committed and ``overwrite`` is not set.
        """
        policy = if_busy or self.if_busy
        if policy not in _IF_BUSY:
            raise ValueError(f"if_busy must be one of {_IF_BUSY}, got {policy!r}")
        step = _as_step(step)
        path = self.step_path(step)
        pending = self._pending
        if policy == "skip" and self._sync.any(pending is not None and not pending.done()):
            log.info("checkpoint of step %d skipped: the previous save (step %s) is still running", step,
                     pending.step if pending else "?")  # fmt: skip
            return None
        if pending is not None:
            pending.exception()  # wait; its error was (or will be) reported through its own handle
        options = {**self.save_options, **save_options}
        future = _save_async(path, state, step, options)
        done = self._executor.submit(self._finish, step, future)
        handle = ManagedSave(step, path, future, done)
        self._pending = handle
        return handle

    def _finish(self, step: int, future: CheckpointFuture) -> Any:
        meta = future.result()
        if self._sync.rank == 0:
            try:
                self.apply_retention(keep=step)
            except Exception:  # noqa: BLE001 - the save is committed; a failed deletion is retried next time
                log.warning("retention after step %d failed; it will be retried after the next save", step,
                            exc_info=True)  # fmt: skip
        return meta

    def wait(self) -> None:
        """Wait for the save in flight (if any); raise its error."""
        pending = self._pending
        if pending is not None:
            pending.result()

    # Restore ---------------------------------------------------------------------------------------------
    def restore(
        self, step: int | None = None, *, state: Mapping[str, Any], **load_options: Any
    ) -> dict[str, Any]:
        """Load ``step`` (default: the newest committed) into ``state``; see :func:`arraycheckpoint.load`.

        Waits for a save in flight first. Raises :class:`CheckpointNotFoundError` when nothing is committed
        (or ``step`` is not).
        """
        import arraycheckpoint as acp

        pending = self._pending
        if pending is not None:
            pending.exception()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.root}: nothing to restore"
                )
        return acp.load(self.step_path(step), state, **{**self.load_options, **load_options})

    # Retention and cleanup ---------------------------------------------------------------------------------
    def steps_to_delete(self, steps: list[int]) -> list[int]:
        """Which of the committed ``steps`` the retention policy removes (pure; the newest always stays)."""
        if self.keep_last is None or not steps:
            return []
        ordered = sorted(steps)
        keep = set(ordered[-self.keep_last :])
        keep.add(ordered[-1])
        if self.keep_every:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        return [s for s in ordered if s not in keep]

    def apply_retention(self, keep: int | None = None) -> list[int]:
        """Delete the committed steps the policy does not keep (coordinator only); returns them.

        Args:
            keep: a step this pass never deletes: the one just committed (a step saved below the newest
                ``keep_last`` ones, e.g. after restoring an older step, would otherwise be deleted right
                after its save returned; a later save's pass applies the policy to it).
        """
        with self._lock:
            policy = self.steps_to_delete(self.all_steps())
            doomed = [
                s for s in policy if s != keep and not being_read(self.storage, self._step_root(s))
            ]  # a step a load in this process is reading is kept (deleted by a later pass)
            if keep in policy:
                log.warning(
                    "step %d is older than the %s newest steps kept under %s: kept for now, deleted by the "
                    "next save's retention", keep, self.keep_last, self.root,
                )  # fmt: skip
            for s in doomed:
                log.info("retention: deleting checkpoint of step %d under %s", s, self.root)
                self.storage.remove_checkpoint(self._step_root(s))
            return doomed

    def cleanup(self) -> list[str]:
        """Remove uncommitted leftovers under ``root`` (staging directories, stale locks, step directories
        without a commit marker holding only what a save writes, half-deleted steps). A save in flight (another
        job's: its lock's flock held, its owner alive, or its lease live) keeps its lock and files; returns
        what was removed. What cannot be removed (a read-only mount or credentials)
        is kept with a warning naming it: a manager that only restores works there."""
        with self._lock:
            removed = self.storage.cleanup_leftovers(self.root)
            for step, path in sorted(self._step_dirs().items()):
                if self._committed(path) is False:
                    foreign = self._foreign_entries(path)
                    if foreign:
                        log.warning(
                            "cleanup: kept %s: it is not a committed checkpoint, but it holds what no save "
                            "writes (%s); move it away or remove it yourself", path, ", ".join(foreign),
                        )  # fmt: skip
                        continue
                    log.info("cleanup: removing uncommitted checkpoint of step %d at %s", step, path)
                    try:
                        if not self.storage.remove_uncommitted(path):  # a live lease: another job's save
                            log.info("cleanup: kept %s: a save in flight holds it, or committed it", path)
                            continue
                    except StorageError as e:  # a read-only mount, read-only credentials: a reader's manager
                        log.warning("cleanup: could not remove %s (%s); it is kept", path, e)
                        continue
                    removed.append(path)
            if removed:
                log.info("cleanup under %s removed %d leftover(s) of crashed saves", self.root, len(removed))
            return removed

    def _foreign_entries(self, path: str, limit: int = 10) -> list[str]:
        """Up to ``limit`` entries below the step ``path`` that no save writes (a user's file, a link, a
        FIFO: :func:`~arraycheckpoint.storage.base.is_checkpoint_key`, the rule a save applies to what it
        finds at its target): a step holding any is not a crashed save's leftover and is never deleted."""
        from .storage import LocalStorage

        if not isinstance(self.storage, LocalStorage):
            return [k for k in self.storage.list(path) if not is_checkpoint_key(k)][:limit]
        found: list[str] = []

        def unreadable(e: OSError) -> None:  # what cannot be looked at is not known to be a save's
            found.append(f"{os.path.relpath(e.filename or path, path)} (unreadable: {e.strerror})")

        for top, dirs, files in os.walk(path, onerror=unreadable):  # never into a linked directory
            if len(found) >= limit:
                return found
            for name in dirs + files:
                full = os.path.join(top, name)
                try:
                    mode = os.lstat(full).st_mode
                except FileNotFoundError:  # gone since the listing
                    continue
                rel = os.path.relpath(full, path).replace(os.sep, "/")
                if not stat.S_ISDIR(mode) and not (stat.S_ISREG(mode) and is_checkpoint_key(rel)):
                    found.append(rel + ("" if stat.S_ISREG(mode) else " (a link or special file)"))
                    if len(found) >= limit:
                        return found
        return found

    def close(self) -> None:
        """Wait for the save in flight and stop the manager's thread.

        A failure of that save is not raised here (its handle's ``result()`` raises it); it is logged.
        """
        pending = self._pending
        error = pending.exception() if pending is not None else None
        if error is not None:
            log.warning("the last checkpoint save (step %d) failed: %s", pending.step, error)
        self._executor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"


def _as_step(step: Any) -> int:
    """``step`` as a plain ``int``: any integer, also a numpy integer or a 0-d integer tensor or jax array
    (``operator.index``, as ``acp.save(step=...)`` takes them); never a bool, a float or a negative."""
    try:
        n = operator.index(step)
    except TypeError:
        n = -1
    if isinstance(step, bool) or n < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return n


def _save_async(path: str, state: Mapping[str, Any], step: int, options: dict[str, Any]) -> CheckpointFuture:
    import arraycheckpoint as acp

    return acp.save_async(path, state, step=step, **options)


class _RankSync:
    """The manager's own agreement between ranks: who is the coordinator, "is any rank busy?", a barrier.

    Under torch.distributed it uses a gloo group of its own, created here (so, collectively) and used only
    from the training thread; never the engine's checkpoint group, which the background save thread uses.
    """

    def __init__(self, comm: Any = None) -> None:
        self._group: Any = None
        self._jax = False
        self.rank = 0
        self.world = 1
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                from .runtime.liveness import default_timeout, join_world

                store = dist.distributed_c10d._get_default_store()
                join_world(
                    store, dist.get_rank(), dist.get_world_size(), default_timeout(), "CheckpointManager()"
                )
            self._group = dist.new_group(backend="gloo")
            self.rank = dist.get_rank(self._group)
            self.world = dist.get_world_size(self._group)
        elif comm is not None:
            self.rank, self.world = comm.rank, comm.world_size
            self._jax = self.world > 1
        else:
            jax = sys.modules.get("jax")
            if jax is not None and jax.process_count() > 1:
                self.rank, self.world, self._jax = jax.process_index(), jax.process_count(), True

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        if self.world == 1:
            return flag
        if self._group is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            return bool(t.item())
        import numpy as np
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.array([int(flag)]))))

    def barrier(self) -> None:
        if self.world == 1:
            return
        if self._group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._group)
            return
        if self._jax:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("arraycheckpoint-manager")


__all__ = ["CheckpointManager", "ManagedSave"]
