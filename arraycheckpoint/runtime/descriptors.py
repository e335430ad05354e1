"""How many file descriptors the readers and writers of packs may keep open: one budget for the whole process.

The budget is an eighth of the descriptors this process may open (``RLIMIT_NOFILE``; at least 2): the rest
stay for the storage library, the process group's sockets and the user's files. Every reader or writer of
packs (a load, a save, each open ``acp.checkpoint_store``) holds a :class:`DescriptorShare` of it. Each had
an eighth of its own before, so eight of them (several open stores, a store beside an async save and a load)
could together exhaust the process's descriptors.

A share's :meth:`~DescriptorShare.limit` (also ``int(share)``) is the number of packs its holder may keep
open *now*, re-computed at each read (a holder reads it before each open, and closes its least recently
used packs down to it):

* the budget is split evenly among the live shares, a share's ``cap`` (its own most) given up to the others
  (water-filling), so one user alone gets ``min(cap, budget)`` as before;
* a share never gets more than the others leave: the budget less what each of them was granted at its
  last read (what it may still hold). Holders above their part that can give packs back at once (a zarr
  store, which may sit idle with packs open: its ``trim``) close idle packs first; the others (a load or a
  save in progress) shrink at their next open. A user joining while those hold the whole budget gets 1
  until then; so the packs open at once stay within the budget, plus one per user that joined since the
  others last opened a pack.

A share leaves the budget when its holder is garbage-collected or calls :meth:`DescriptorShare.release`
(reading it again joins again).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable


def process_budget() -> int | None:
    """The descriptors all readers and writers of packs may keep open together: an eighth of the process's
    ``RLIMIT_NOFILE`` (at least 2), or None where the process has no such limit."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return max(2, soft // 8)


class _Budget:
    """The live shares of the process (by identity: a share compares equal to an int)."""

    def __init__(self) -> None:
        # reentrant: a share collected while the lock is held (a collection run by an allocation there) leaves
        self.lock = threading.RLock()
        self.shares: dict[int, weakref.ref[DescriptorShare]] = {}

    def join(self, share: DescriptorShare) -> None:
        key = id(share)
        with self.lock:
            if key not in self.shares:
                self.shares[key] = weakref.ref(share, lambda _r, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        with self.lock:
            self.shares.pop(key, None)

    def leave(self, share: DescriptorShare) -> None:
        with self.lock:
            self.shares.pop(id(share), None)
            share.granted = 0

    def live(self) -> list[DescriptorShare]:
        return [s for s in (r() for r in list(self.shares.values())) if s is not None]

    def limit(self, share: DescriptorShare) -> int:
        total = process_budget()
        if total is None:
            return share.cap
        self.join(share)
        with self.lock:
            fair, over = self._fair(total, share)
        # holders over their part that can close packs nobody reads (idle stores) do so now, outside the
        # budget's lock (a holder's trim takes its own lock, never waiting for it)
        for other, part in over:
            held = other.trim(part)
            with self.lock:
                other.granted = min(other.granted, max(held, part))
        with self.lock:
            left = total - sum(s.granted for s in self.live() if s is not share)
            share.granted = max(1, min(fair, left))
            return share.granted

    def _fair(self, total: int, share: DescriptorShare) -> tuple[int, list[tuple[DescriptorShare, int]]]:
        """``share``'s even part of ``total``, and, when the others leave it less, those of them above their
        own part that can give packs back (a trim)."""
        live = self.live()
        fairs = _water_fill(total, [s.cap for s in live])
        fair = fairs[next(i for i, s in enumerate(live) if s is share)]
        if total - sum(s.granted for s in live if s is not share) >= fair:
            return fair, []
        over = [(s, f) for s, f in zip(live, fairs) if s is not share and s.granted > f and s.can_trim]
        return fair, over


def _water_fill(total: int, caps: list[int]) -> list[int]:
    """``total`` split evenly among users wanting at most ``caps`` (what a small cap leaves goes to the
    others); every user gets at least 1."""
    out = [0] * len(caps)
    left, users = total, len(caps)
    for i in sorted(range(len(caps)), key=caps.__getitem__):
        out[i] = max(1, min(caps[i], left // users))
        left -= out[i]
        users -= 1
    return out


_BUDGET = _Budget()


class DescriptorShare:
    """One reader's or writer's part of the process's descriptor budget (module docstring). Its holder
    reads :meth:`limit` (or ``int(share)``) before each pack it opens: the packs it may keep open now, at
    most ``cap``."""

    def __init__(self, cap: int, trim: Callable[[int], int] | None = None) -> None:
        """Args:
        cap: the most packs the holder ever keeps open.
        trim: for a holder that may sit idle with packs open (a zarr store): closes packs nobody reads down
            to the given count, without waiting for its own lock, and returns how many it still holds; the
            budget calls it when a newcomer would otherwise get less than its part. Held weakly (a bound
            method does not keep its holder alive)."""
        self.cap = max(1, cap)
        #: what this share was last told (its holder may still hold that many): kept from the others
        self.granted = 0
        self._trim = weakref.WeakMethod(trim) if inspect.ismethod(trim) else trim
        self._budget = _BUDGET  # kept: a holder's __del__ may release it while the interpreter finalizes
        self._budget.join(self)

    @property
    def can_trim(self) -> bool:
        return self._trim is not None

    def trim(self, count: int) -> int:
        """Ask the holder to close packs nobody reads down to ``count``; how many it still holds."""
        fn = self._trim() if isinstance(self._trim, weakref.WeakMethod) else self._trim
        return self.granted if fn is None else int(fn(count))

    def limit(self) -> int:
        """The packs the holder may keep open now (it closes its least recently used ones down to that)."""
        return self._budget.limit(self)

    def release(self) -> None:
        """Give the share back (its holder closed its packs); reading it again joins the budget again."""
        self._budget.leave(self)

    def __index__(self) -> int:
        return self.limit()

    __int__ = __index__

    def __repr__(self) -> str:
        return f"DescriptorShare(cap={self.cap}, granted={self.granted})"


def descriptor_share(cap: int, trim: Callable[[int], int] | None = None) -> DescriptorShare:
    """A new share of the process's descriptor budget for one reader or writer of packs, keeping at most
    ``cap`` open (module docstring): it reads as an ``int``, the packs its holder may keep open now (an
    eighth of ``RLIMIT_NOFILE`` split among the live shares; ``cap`` where the process has no limit)."""
    return DescriptorShare(cap, trim)


def live_shares() -> int:
    """How many shares are live in this process (for tests and monitoring)."""
    with _BUDGET.lock:
        return len(_BUDGET.live())
