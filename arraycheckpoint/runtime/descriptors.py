"""How many file descriptors the readers and writers of packs may keep open: one budget for the whole process.

The budget is an eighth of the descriptors this process may open (``RLIMIT_NOFILE``; at least 2): the rest
stay for the storage library, the process group's sockets and the user's files. Every reader or writer of
packs (a load, a save, each open ``acp.checkpoint_store``) holds a :class:`DescriptorShare` of it. Each had
an eighth of its own before, so eight of them (several open stores, a store beside an async save and a load)
could together exhaust the process's descriptors.

A share reads as an ``int``: the number of packs its holder may keep open *now*, re-computed at each read
(a holder reads it before each open, and closes its least recently used packs down to it):

* the budget is split evenly among the live shares, a share's ``cap`` (its own most) given up to the others
  (water-filling), so one user alone gets ``min(cap, budget)`` as before;
* a share never gets more than the others leave: the budget less what each of them was granted at its
  last read (what it may still hold). A user joining while the others hold the whole budget gets 1 until
  their next opens shrink them to their share; so the packs open at once stay within the budget, plus
  one per user that joined since the others last opened a pack.

A share leaves the budget when its holder is garbage-collected or calls :meth:`DescriptorShare.release`
(reading it again joins again).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any


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
            live = self.live()
            fair = _water_fill(total, [s.cap for s in live])[
                next(i for i, s in enumerate(live) if s is share)
            ]
            left = total - sum(s.granted for s in live if s is not share)
            share.granted = max(1, min(fair, left))
            return share.granted


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
    """One reader's or writer's part of the process's descriptor budget (module docstring). Reads as an
    ``int`` (``int()``, comparisons, arithmetic): the packs its holder may keep open now, at most ``cap``."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        #: what this share was last told (its holder may still hold that many): kept from the others
        self.granted = 0
        self._budget = _BUDGET  # kept: a holder's __del__ may release it while the interpreter finalizes
        self._budget.join(self)

    def limit(self) -> int:
        """The packs the holder may keep open now (it closes its least recently used ones down to that)."""
        return self._budget.limit(self)

    def release(self) -> None:
        """Give the share back (its holder closed its packs); reading it again joins the budget again."""
        self._budget.leave(self)

    def __index__(self) -> int:
        return self.limit()

    __int__ = __index__
    __hash__ = object.__hash__  # by identity (a share is one holder's, whatever its value now)

    def __eq__(self, other: Any) -> bool:
        return self.limit() == other if isinstance(other, int) else self is other

    def __lt__(self, other: int) -> bool:
        return self.limit() < other

    def __le__(self, other: int) -> bool:
        return self.limit() <= other

    def __gt__(self, other: int) -> bool:
        return self.limit() > other

    def __ge__(self, other: int) -> bool:
        return self.limit() >= other

    def __sub__(self, other: int) -> int:
        return self.limit() - other

    def __rsub__(self, other: int) -> int:
        return other - self.limit()

    def __add__(self, other: int) -> int:
        return self.limit() + other

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"DescriptorShare(cap={self.cap}, granted={self.granted})"


def descriptor_share(cap: int) -> DescriptorShare:
    """A new share of the process's descriptor budget for one reader or writer of packs, keeping at most
    ``cap`` open (module docstring): it reads as an ``int``, the packs its holder may keep open now (an
    eighth of ``RLIMIT_NOFILE`` split among the live shares; ``cap`` where the process has no limit)."""
    return DescriptorShare(cap)


def live_shares() -> int:
    """How many shares are live in this process (for tests and monitoring)."""
    with _BUDGET.lock:
        return len(_BUDGET.live())
