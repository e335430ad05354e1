"""Format 6 in :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore`: a member found in its rank's packs.

A member of a format-6 packed array is looked for in the pack of its rank that the metadata predicts holds it,
as the load looks for it, and only that pack's directory is read
(:class:`arraycheckpoint.audit.rankpacks.RankPacks`: each entry a member that rank holds, none twice, the
packs' capacity counted before a key is built per chunk; the rank's packs in order only when a member is not
where predicted), on a thread of its own (object stores: each read run on the store's event loop,
:class:`_StoreRanges`).

**Read ahead on object stores.** zarr-python asks for many keys at once (``members()`` fetches up to
``async.concurrency`` documents at a time, an array read as many chunks): each used to walk its pack alone, one
after another behind the walk lock, so 64 packs 50 ms away cost 64 round trips (two each: the pack's size,
then its end). The members asked for while a walk waits are now walked together (:meth:`RankWalks._rank_member`
collects them; :meth:`RankWalks._walk_members`), and the ends of the packs that walk reads are read ahead by
the load's own mechanism (:class:`arraycheckpoint.audit.ahead.EndReads`, planned by
:meth:`~arraycheckpoint.audit.rankpacks.RankPacks.ends`), as are the directories a capacity count reads
(:meth:`~arraycheckpoint.audit.rankpacks.RankPacks.capacity`). The same packs are read, with the same
requests and the same checks; a pack that fails is reported to the request that needed it (the others of its
batch walk again on their own).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..format.metadata import CheckpointMetadata

#: a member asked for: (rank, key)
Wanted = tuple[int, str]


class RankWalks:
    """The format-6 half of :class:`~arraycheckpoint.interop.zarrpacks.PackReading` (see the module
    docstring); ``_ranks`` maps rank -> member -> (pack, member) of the packs read so far."""

    _meta: CheckpointMetadata
    _local: str | None
    _name: str
    _ranks: dict[int, dict[str, tuple[Any, Any]]]

    def _chunks_of(self, name: str, rank: int) -> np.ndarray:
        """The chunks (flat indices, ascending) of the packed array ``name`` that ``rank`` wrote: its writers
        grouped by rank once per array (a store reads every rank's packs: a scan of every writer per rank
        would cost ranks x chunks)."""
        cache = self.__dict__.setdefault("_by_writer", {})
        grouped = cache.get(name)
        if grouped is None:
            writers = self._meta.tensors[name].writers
            ranks = np.asarray(getattr(writers, "array", writers), dtype=np.int64)
            order = np.argsort(ranks, kind="stable")
            grouped = cache[name] = (order, ranks[order])
        order, ranks = grouped
        return order[np.searchsorted(ranks, rank, "left") : np.searchsorted(ranks, rank, "right")]

    async def _rank_member(self, rank: int, key: str) -> Any:
        """Format 6: the member ``key`` of ``rank``'s packs, with the other members of the pack holding it:
        only that pack's directory is read and checked (the pack the metadata predicts, as a save fills its
        packs: :func:`arraycheckpoint.audit.predict.predicted_packs`, as the load finds it), by the
        enumeration every reader shares (:class:`arraycheckpoint.audit.rankpacks.RankPacks`: the load and
        ``verify`` accept and refuse what this store does), after the packs' capacity is checked (before a
        key is built per chunk). A member not where predicted, or a checkpoint that records no fill target:
        the rank's packs in order, up to the one holding it (every pack when none predicts a member). The
        members other requests ask for meanwhile are walked with it, their packs' ends read ahead."""
        damaged = self._damaged
        found = self._ranks.get(rank, {}).get(key)
        if found is None and key not in damaged:
            me = (rank, key)
            wanted: dict[Wanted, None] = self.__dict__.setdefault("_wanted", {})
            # (walk number, error) of a member whose pack failed in another request's walk: only an error of
            # a walk begun after this request counts (one kept for a request cancelled since is not served to
            # a later one: that walks again)
            errors: dict[Wanted, tuple[int, BaseException]] = self.__dict__.setdefault("_walk_errors", {})
            begun = self.__dict__.get("_walks_begun", 0)
            wanted[me] = None

            async def batch() -> tuple[int, list[Wanted]]:
                await _settled(wanted)  # the other requests issued with this one have queued their members
                out = [me] + [
                    w
                    for w in wanted
                    if w != me and w[1] not in self._ranks.get(w[0], {}) and w[1] not in damaged
                ]
                wanted.clear()
                number = self.__dict__["_walks_begun"] = self.__dict__.get("_walks_begun", 0) + 1
                return number, out

            def failed() -> BaseException | None:
                got = errors.get(me)
                return got[1] if got is not None and got[0] > begun else None

            def done() -> bool:
                return key in self._ranks.get(rank, {}) or key in damaged or failed() is not None

            try:
                await self._walking(self._walk_members, done, batch)
            finally:
                wanted.pop(me, None)
            error = failed()
            if error is not None:  # its pack failed in another request's walk
                raise error
            found = self._ranks.get(rank, {}).get(key)
        if found is None and key in damaged:  # its own entry is damaged: this array's requests fail alone
            raise damaged[key]
        return found

    @property
    def _damaged(self) -> dict[str, BaseException]:
        """Members whose own directory entry is damaged (compressed, oversized), each with the error naming
        its array: the walk serves the pack's other members (:meth:`RankPacks.check
        <arraycheckpoint.audit.rankpacks.RankPacks.check>`), and every request for one of these fails."""
        return self.__dict__.setdefault("_damaged_members", {})  # type: ignore[no-any-return]

    async def _capacity(self, name: str) -> None:
        """Format 6: the packs of the ranks writing chunks of ``name`` can hold what they hold
        (:meth:`arraycheckpoint.audit.rankpacks.RankPacks.capacity`: a local path's file sizes, an object
        store's directory entries, counted only for a rank of very many members, read ahead, and kept for the
        check that reads them next), before its keys are listed one per chunk; each rank checked once."""
        writers = self._meta.tensors[name].writers
        checked = self.__dict__.setdefault("_capacity_checked", set())
        if len(writers) <= 1:
            return
        ranks = [
            r for r in np.unique(np.asarray(getattr(writers, "array", writers))).tolist() if r not in checked
        ]
        if ranks:
            await self._walking(lambda walk: walk.capacity(*ranks), None)
        checked.update(ranks)

    async def _walking(
        self,
        work: Callable[..., Any],
        done: Callable[[], bool] | None,
        prepare: Callable[[], Awaitable[Any]] | None = None,
    ) -> Any:
        """``work(walk)`` with a :class:`arraycheckpoint.audit.rankpacks.RankPacks` of the checkpoint, run on
        a thread of its own, one at a time (a walk waits on reads run on this loop, which may need the
        default executor's threads, as fsspec's wrapped file systems do: walks there could take them all);
        ``done()``: whether a finished walk already did the work (:meth:`_rank_member`); ``prepare()``: run
        on the loop once the walk is this one's turn, what is passed to ``work`` after the walk."""
        from ..audit.capacity import _rank_members
        from ..audit.packcount import PackCounts
        from ..audit.rankpacks import RankPacks
        from ..storage.local import LocalStorage

        loop = asyncio.get_running_loop()
        locks = self.__dict__.setdefault("_walk_locks", weakref.WeakKeyDictionary())
        lock = locks.setdefault(loop, asyncio.Lock())  # a lock belongs to one event loop
        async with lock:
            if done is not None and done():
                return None
            args = () if prepare is None else (await prepare(),)
            pool = self.__dict__.get("_walk_pool")
            if pool is None:
                pool = self.__dict__["_walk_pool"] = ThreadPoolExecutor(1, thread_name_prefix="acp-store")
            holds = self.__dict__.get("_holds")
            if holds is None:
                holds = self.__dict__["_holds"] = _rank_members(self._meta)
            # directories an object store's capacity count read, checked later without a second read
            parsed = self.__dict__.setdefault("_parsed", {})
            if self._local is not None:
                walk = RankPacks(LocalStorage(), self._local, self._meta, holds, parsed)
            else:
                storage = _StoreRanges(self, loop)
                counts = self.__dict__.setdefault("_pack_counts", weakref.WeakKeyDictionary())
                if (
                    loop not in counts
                ):  # one listing of the packs per store (a checkpoint without fill target)
                    counts[loop] = PackCounts(storage, self._name, self._meta.world_size)
                walk = RankPacks(storage, self._name, self._meta, holds, parsed, counts[loop])
            return await loop.run_in_executor(pool, work, walk, *args)

    def _rank_plan(self, walk: Any, rank: int) -> tuple[Any, ...]:
        """``rank``'s members grouped by the pack predicted to hold them, and what its walks found so far:
        ``(every member, member -> pack, pack -> members, packs not yet read, members seen, packs opened)``."""
        from ..audit.predict import predicted_packs

        plans = self.__dict__.setdefault("_rank_plans", {})
        plan = plans.get(rank)
        if plan is None:  # every member of the rank, by the pack predicted to hold it (None: no prediction)
            whole = walk.whole_rank(rank, lambda name: self._chunks_of(name, rank), counted=True)
            docs, chunks = walk.holds.get(rank, ([], {}))
            where = predicted_packs(self._meta, rank, whole, docs, chunks, walk.target)
            groups: dict[int | None, dict[str, tuple[str, int]]] = {}
            for member, place in whole.items():
                groups.setdefault(where.get(member), {})[member] = place
            plan = plans[rank] = (whole, where, groups, set(groups), set(), set())
        return plan  # type: ignore[no-any-return]

    def _walk_members(self, walk: Any, numbered: tuple[int, list[Wanted]]) -> None:
        """:meth:`_rank_member` in the walks' thread, for every member of the batch (its caller's first) of
        the walk ``numbered`` (``(walk number, batch)``): the
        members of each pack predicted to hold one read and checked, and kept, the packs' ends read ahead
        (object stores). The caller's failure is raised; another's is kept for its own request."""
        from ..audit.ahead import EndReads

        number, batch = numbered
        plans = self.__dict__.setdefault("_rank_plans", {})
        checked = self.__dict__.setdefault("_capacity_checked", set())
        new = [r for r in dict.fromkeys(r for r, _k in batch) if r not in plans and r not in checked]
        if new:  # the ranks first read: their capacity counted (read ahead together) before keys are built
            try:
                walk.capacity(*new)
                checked.update(new)
            except Exception:
                if batch[0][0] in new:  # the caller's own rank counted alone: its own error raised
                    walk.capacity(batch[0][0])
                    checked.add(batch[0][0])
                # the others' ranks are counted by their own requests (each then fails naming its arrays)
                batch = [w for w in batch if w[0] in checked or w[0] in plans]
        steps: list[tuple[int, list[str], Any, dict[str, tuple[str, int]], bool]] = []
        taken: dict[
            int, tuple[set[Any], set[int]]
        ] = {}  # rank -> (groups walked in this batch, packs opened)
        jobs = []
        for rank, key in batch:
            _whole, where, groups, left, _seen, opened = self._rank_plan(walk, rank)
            at = where.get(key)
            walked, will_open = taken.setdefault(rank, (set(), set(opened)))
            if at in walked:  # in a pack an earlier step reads
                next(s for s in steps if s[0] == rank and s[2] == at)[1].append(key)
                continue
            walked.add(at)
            reading = groups[at] if at is not None else _whole
            to_end = not left - walked  # the rank's last pack group: its other packs too
            jobs += walk.ends(rank, reading, to_end=to_end, opened=will_open)
            steps.append((rank, [key], at, reading, to_end))
        remote = getattr(walk.storage, "commit_strategy", "") != "rename"
        walk.ahead = EndReads(walk.storage, walk.base, jobs) if remote and jobs else None
        errors = self.__dict__.setdefault("_walk_errors", {})
        try:
            for i, (rank, keys, at, reading, to_end) in enumerate(steps):
                try:
                    self._walk_pack(walk, rank, keys[0], at, reading, to_end)
                except Exception as e:
                    if i == 0:
                        raise
                    errors.update(dict.fromkeys(((rank, k) for k in keys), (number, e)))
                    break  # the others walk on their own
        finally:
            if walk.ahead is not None:
                walk.ahead.close()

    def _walk_pack(
        self, walk: Any, rank: int, key: str, at: Any, reading: dict[str, tuple[str, int]], to_end: bool
    ) -> None:
        """The members ``reading`` of ``rank``'s pack ``at`` (predicted to hold ``key``) read and checked,
        and kept; ``to_end``: the last group of the rank, whose walk reads the rank's other packs too."""
        whole, _where, _groups, left, seen, opened = self._rank_plan(walk, rank)
        left.discard(at)
        directories: dict[str, list[Any]] = {}
        deferred: dict[str, dict[str, int]] = {}
        # the last pack of the rank read: the rank's other packs too, as a reader of every member reads them
        # (a member in two packs is refused by every reader alike)
        damaged = self._damaged
        try:
            walk.check(
                rank, reading, directories, deferred, seen=seen, opened=opened, to_end=to_end, damaged=damaged
            )
        except BaseException:  # the packs it opened count as read: the rank planned afresh by the next walk,
            self.__dict__.get("_rank_plans", {}).pop(rank, None)  # which reads them again (never "missing")
            raise
        self._keep(rank, directories, deferred)
        if key not in self._ranks[rank] and key not in damaged:  # not where predicted, in a pack read before
            directories, deferred = {}, {}  # for another member: every pack of the rank read again
            walk.check(rank, whole, directories, deferred, damaged=damaged)  # (a damaged or foreign layout)
            self._keep(rank, directories, deferred)

    def _keep(
        self, rank: int, directories: dict[str, list[Any]], deferred: dict[str, dict[str, int]]
    ) -> None:
        """The members of ``rank``'s packs just checked (:meth:`_walk_pack`), exposed."""
        from .zarrpacks import _Member, _Pack

        found = self._ranks.setdefault(rank, {})
        for pkey, entries in directories.items():
            following = deferred.get(pkey, {})
            members = {
                e.filename: _Member(e, e.file_size, following[e.filename])
                for e in entries
                if e.filename in following
            }
            pack = _Pack(pkey, members)
            found.update((name, (pack, m)) for name, m in members.items() if name not in found)


async def _settled(wanted: dict[Wanted, None]) -> None:
    """Return once the requests ready to run have queued their members in ``wanted`` (yield to the loop until
    none is added): zarr-python's concurrent reads reach the store within a step of each other."""
    seen = -1
    while seen != len(wanted):
        seen = len(wanted)
        await asyncio.sleep(0)


class _StoreRanges:
    """The reads of an object store's packs for :class:`arraycheckpoint.audit.rankpacks.RankPacks`, through
    the store's zarr store (``pack_ranges``, what :func:`arraycheckpoint.audit.packdir._pack_directory` reads
    a pack with), from a worker thread, each read run on the store's event loop ``loop``."""

    commit_strategy = "marker"

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.store, self.loop = store, loop

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def pack_ranges(
        self, base: str, key: str, want: int
    ) -> tuple[bytes, int | None, Callable[[list[tuple[int, int | None]]], list[bytes]]] | None:
        """The last ``want`` bytes of the pack ``key``, its size and a reader of its byte ranges; None when
        it is absent."""
        store = self.store

        async def tail() -> tuple[int, bytes] | None:
            try:  # its size says it is there: one request, not two
                size = int(await store._base.getsize(key))
            except FileNotFoundError:
                return None
            return size, await store._read(key, max(0, size - want), size)

        got = self._run(tail())
        if got is None:
            return None
        size, last = got

        def read(ranges: list[tuple[int, int | None]]) -> list[bytes]:
            async def every() -> list[bytes]:
                return list(
                    await asyncio.gather(
                        *(store._read(key, o, size if n is None else o + n) for o, n in ranges)
                    )
                )

            return self._run(every())

        return last, size, read

    def list_packs(self, base: str, limit: int | None = None) -> list[str] | None:
        """The names in the checkpoint's ``.acp/packs/`` (one listing:
        :class:`arraycheckpoint.audit.packcount.PackCounts`), or None where there are more than ``limit``: an
        S3 file system (s3fs) is asked for pages up to the one holding the ``limit + 1``-th name, and nothing it
        lists is cached (a cached listing answered later stores' sizes: :func:`forget_listings`); another file
        system is listed through zarr's store."""
        from ..planning.packing import PACK_DIR

        base_store = self.store._base
        fs = getattr(base_store, "fs", None)
        paged = getattr(fs, "_iterdir", None)

        async def names() -> list[str] | None:
            if paged is not None and limit is not None and hasattr(fs, "split_path"):
                bucket, key, _ = fs.split_path(f"{base_store.path}/{PACK_DIR}")
                out: list[str] = []
                pages = paged(bucket, prefix=key.strip("/") + "/")  # a page is asked for as it is reached
                try:
                    async for info in pages:
                        out.append(str(info.get("name") or info.get("Key", "")))
                        if len(out) > limit:
                            return None
                finally:
                    await pages.aclose()
                return out
            got = [k async for k in base_store.list_dir(PACK_DIR)]
            return None if limit is not None and len(got) > limit else got

        return self._run(names())  # type: ignore[no-any-return]


def forget_listings(base: Any) -> None:
    """Drop what the file system of the zarr store ``base`` (an ``FsspecStore``) cached of its root and
    everything below: opened again on a checkpoint since overwritten at the same URL, a store took the sizes
    of its packs from the listing an earlier store made (s3fs keeps listings on a file system object reused
    for the same options, for the life of the process) and refused the new packs as damaged. A store sees the
    checkpoint as it is when it opens; any other store: nothing to drop."""
    fs, path = getattr(base, "fs", None), getattr(base, "path", None)
    if fs is None or not isinstance(path, str):
        return
    root = path.rstrip("/")
    for each in (fs, getattr(fs, "sync_fs", None)):  # zarr wraps a synchronous file system
        cache = getattr(each, "dircache", None)
        if cache is None:
            continue
        try:
            each.invalidate_cache(root)  # the root and its parents
            for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(root + "/")]:
                cache.pop(key, None)
        except Exception:  # noqa: BLE001 - a file system without a cache, or one that cannot drop it
            pass
