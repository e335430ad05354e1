"""The one exchange a save may have: fragments of chunks that straddle ranks' regions (flat ranges, FSDP1).

:class:`FragmentExchange` runs the batched all-to-all on a thread of its own while the rank writes the chunks it
holds whole; the writes that need fragments come last and wait for it. Every rank enters the collective, a failed
one too (with zeros), so no rank blocks in it while another waits in the commit.
"""

from __future__ import annotations

import threading

import numpy as np

from ..codecs import numpy_dtype
from ..errors import SaveFailedError
from ..planning.plan import RankPlan
from ..planning.regions import Box
from .common import describe
from .job import SaveJob


class FragmentExchange:
    """The fragment all-to-all of one save, started at once on its own thread (nothing to do when the plan has
    no straddling chunk or the world is one rank). :meth:`received` waits for it; :meth:`join` must be called
    before the commit's collectives on every path (a collective in flight on one thread at a time)."""

    def __init__(self, job: SaveJob, plan: RankPlan) -> None:
        self._job, self._plan = job, plan
        self._out: dict[tuple[str, Box], np.ndarray] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if job.comm.world_size > 1 and plan.exchange:
            self._thread = threading.Thread(target=self._run, name="acp-exchange", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._out = exchange_fragments(self._job, self._plan)
        except BaseException as e:  # noqa: BLE001 - raised on the pipeline's thread by join()
            self._error = e

    def received(self) -> dict[tuple[str, Box], np.ndarray]:
        """The fragments this rank receives, ``(tensor, box) -> array`` (waits for the exchange)."""
        self.join()
        return self._out

    def join(self) -> None:
        """Wait for the exchange; raises its failure once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def exchange_fragments(job: SaveJob, plan: RankPlan) -> dict[tuple[str, Box], np.ndarray]:
    """Ship fragments of straddling chunks to their writers: one batched all-to-all per save."""
    comm = job.comm
    if comm.world_size == 1 or not plan.exchange:
        return {}
    with job.recorder.phase("exchange") as rec:
        # one send buffer per peer, each fragment copied into it once (no concatenate of copies)
        sizes = [0] * comm.world_size
        for t in plan.sends:
            sizes[t.dst] += t.box.volume * job.dtypes[t.name].itemsize
        flat = [np.zeros(n, np.uint8) for n in sizes]  # zeros: what a failed rank sends
        cursor = [0] * comm.world_size
        for t in plan.sends:
            dtype = job.dtypes[t.name]
            n = t.box.volume * dtype.itemsize
            if job.error is None:  # a failed rank still enters the collective, with zeros
                try:
                    dest = flat[t.dst][cursor[t.dst] : cursor[t.dst] + n].view(dtype).reshape(t.box.lengths)
                    dest[...] = local_view(job, t.name, t.box)
                except Exception as e:  # noqa: BLE001 - reported at commit; the collective must still run
                    job.error = describe(e, comm.rank)
            cursor[t.dst] += n
        recv_dtypes = {layout.name: numpy_dtype(layout.dtype) for layout in plan.layouts}
        recv_sizes = [0] * comm.world_size
        for t in plan.recvs:
            recv_sizes[t.src] += t.box.volume * recv_dtypes[t.name].itemsize
        got = comm.all_to_all_bytes(flat, recv_sizes)
        out: dict[tuple[str, Box], np.ndarray] = {}
        cursor = [0] * comm.world_size
        for t in plan.recvs:
            dtype = recv_dtypes[t.name]
            n = t.box.volume * dtype.itemsize
            raw = got[t.src][cursor[t.src] : cursor[t.src] + n]
            cursor[t.src] += n
            out[(t.name, t.box)] = raw.view(dtype).reshape(t.box.lengths)
        rec["bytes"] = sum(recv_sizes)
    return out


def local_view(job: SaveJob, name: str, box: Box) -> np.ndarray:
    for held, buf in job.local.get(name, ()):
        if held == box:  # the whole held region (every small tensor): no view to cut
            return buf
        if held.contains(box):
            return buf[box.slices(held)]
    raise SaveFailedError(f"rank {job.comm.rank}: tensor {name!r} region {box} was not in the snapshot")
