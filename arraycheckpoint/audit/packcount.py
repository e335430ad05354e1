"""How many packs each rank's save wrote, for checkpoints whose metadata does not say (no fill target).

A format-6 checkpoint records its packs' fill target in every ``pack`` entry (``.acp/packs/<rank>@<target>``),
from which a reader computes how many packs each rank wrote
(:func:`arraycheckpoint.audit.predict.predicted_fill`). Checkpoints of the first format-6 code record none: a
reader of every member of a rank then read the rank's packs in order up to the first absent one, one request
for an object that is not there per rank (a GET or HEAD answered 404 on S3, after the rank's last pack), and
could read no pack ahead (:class:`arraycheckpoint.audit.ahead.EndReads` reads what it knows the walk will
read). On an object store :class:`PackCounts` lists ``.acp/packs/`` once instead (one request per 1,000
packs, made only when such a rank is read whole) and takes each rank's count from it: ``<rank>.0.zip`` up to
the first index absent there, which is where the probe stopped. A listing the store refuses (a reader allowed
``GetObject`` but not ``ListBucket``) or that fails leaves the probe in place, as before. Local checkpoints
keep the probe: a failed ``open`` of an absent file costs microseconds.

The listing is bounded: at most :data:`LISTED_PER_RANK` names per rank of the world (a page of 1,000 per
rank: never more requests than the probe of every rank) where the store can stop a listing (the zarr store's
reader on S3); a directory holding more (a world of very many packs, or strays) is probed, as before.

Nothing else changes: a pack the listing omits (a store whose listings lag its writes) leaves a member
unfound, and the walk then reads on past the count, up to the first absent pack, as it did; a pack past the
count (after a gap) is no part of the checkpoint, as for the probe.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from ..planning.packing import PACK_DIR

#: names of ``.acp/packs/`` listed per rank of the world at most (:class:`PackCounts`); past them, the probe
LISTED_PER_RANK = 1000

#: a pack's name in ``.acp/packs/`` (as :data:`arraycheckpoint.planning.packing.PACK_KEY` accepts it)
_NAME = re.compile(r"^(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.zip\Z")


class PackCounts:
    """The packs per rank of the checkpoint ``base`` on ``storage``, from one listing of its packs, made on
    first use (object stores only; see the module docstring). ``storage`` lists them with ``list_packs(base)``
    where it has one (the zarr store's reader), else with :meth:`~arraycheckpoint.storage.Storage.children`.
    Thread-safe; shared by the walks of one reader (the zarr store keeps one for its lifetime). ``world``: the
    checkpoint's world size, which bounds a ``list_packs`` listing (:data:`LISTED_PER_RANK` names per rank)."""

    def __init__(self, storage: Any, base: str, world: int | None = None) -> None:
        self._storage, self._base = storage, base.rstrip("/")
        self._limit = None if world is None else max(1, world) * LISTED_PER_RANK
        self._lock = threading.Lock()
        self._listed: dict[int, set[int]] | None = None
        self._tried = False
        #: listings made (what the tests count)
        self.listings = 0

    def written(self, rank: int) -> int | None:
        """How many packs ``rank`` wrote (``<rank>.0.zip`` up to the first absent index), or None where no
        listing answers (a local checkpoint, a listing refused or failed): the reader probes then."""
        if getattr(self._storage, "commit_strategy", "") == "rename":
            return None
        with self._lock:
            if not self._tried:
                self._tried = True
                self._listed = self._list()
            listed = self._listed
        if listed is None:
            return None
        have = listed.get(rank, set())
        k = 0
        while k in have:
            k += 1
        return k

    def _list(self) -> dict[int, set[int]] | None:
        lister = getattr(self._storage, "list_packs", None)
        self.listings += 1
        try:
            names = (
                lister(self._base, self._limit)
                if lister is not None
                else self._storage.children(f"{self._base}/{PACK_DIR}")
            )
        except Exception:  # noqa: BLE001 - refused or failed: the walk probes instead, as it did before
            return None
        if names is None:  # more than the bound: probed, as before
            return None
        out: dict[int, set[int]] = {}
        for name in names:
            m = _NAME.match(name.rstrip("/").rpartition("/")[2])
            if m:
                out.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        return out
