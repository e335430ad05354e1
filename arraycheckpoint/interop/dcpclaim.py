"""The claim :class:`~arraycheckpoint.interop.dcpwriter.Writer` takes on its target, as ``acp.save`` does: the
save lock (a lease on object stores), taken by the coordinator in ``prepare_global_plan`` and given back in
``finish``, or, when the save failed between the two (a rank's ``finish_plan`` or a collective raised: DCP
then calls no ``finish``), by the Writer's next save or once the Writer is dropped (:class:`Claim`). The
ranks write in place under the coordinator's lease as ``acp.save``'s ranks do: its grant travels in the plan
(:func:`lease_data`), each rank follows it (:func:`follow`) and checks it before each write batch."""

from __future__ import annotations

import weakref
from typing import Any

from ..storage import Storage


def _release(storage: Storage, final: str, token: str) -> None:
    """Give back the claim: a failure is logged, never raised (the save's outcome, its error or its commit, is
    what the caller hears; a lock left behind is a crashed save's to the next save or a manager's cleanup)."""
    from ..engine.coordinate import _cleanup

    _cleanup("release", lambda: storage.release(final, token), final)


class Claim:
    """The lock of ``final`` held by the save ``token`` on ``storage`` (``staging``: where its ranks write),
    given back by :meth:`release` (once), or when ``owner`` (the Writer) is garbage."""

    def __init__(self, owner: object, storage: Storage, final: str, token: str, staging: str) -> None:
        self.storage, self.final, self.token, self.staging = storage, final, token, staging
        self._finalizer = weakref.finalize(owner, _release, storage, final, token)

    def release(self) -> None:
        """Give the claim back (idempotent; a failure is logged)."""
        self._finalizer()

    def lease_data(self, world: int) -> dict[str, Any]:
        """What every rank of a save of ``world`` ranks needs to write under this claim (JSON values): the
        target, the save's token and the coordinator's lease grant (:meth:`Storage.lease_grant`)."""
        grant = self.storage.lease_grant(self.final)
        return {"final": self.final, "token": self.token, "grant": [int(v) for v in grant], "world": world}


def follow(storage: Storage, staging: str, data: dict[str, Any] | None, rank: int) -> str | None:
    """On a rank that does not hold the claim: follow the coordinator's lease (``data``: :meth:`Claim.lease_data`)
    so that :meth:`Storage.check_lease` stops this rank's writes before another save may take the target over
    (writing in place under a lease; nothing to follow elsewhere); the target to check, or None."""
    if not isinstance(data, dict):
        return None
    final = str(data["final"])
    storage.follow_lease(staging, final, str(data["token"]), list(data["grant"]), rank, int(data["world"]))
    return final
