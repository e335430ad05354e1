"""The Communicator seam: every collective arraycheckpoint runs goes through one of these.

Objects travel as JSON (never pickle); bulk fragments travel as raw byte buffers, point to point between the
pairs that have bytes to move. Nothing on the save path sends a rank O(world size x payload) bytes: agreements
are fixed-size all-reduces, declarations are gathered on the coordinator only, and the plan is broadcast once.
Implementations: :class:`SingleProcessCommunicator` (no process group at all), :class:`TorchCommunicator`
(a dedicated gloo group created once, never the training group, so background checkpoint collectives cannot
interleave with training collectives), and the JAX multi-controller one in ``adapters.jax``.
Only the engine calls these, from one thread per process, in the same order on every rank.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np


class Communicator(ABC):
    """Collectives over the ranks that take part in a checkpoint. Call order must match on every rank."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def session_id(self) -> str:
        """An identifier agreed by all ranks when the communicator was created (names staging areas)."""

    @abstractmethod
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank. Every rank receives the sum of all payloads:
        used only for fixed-size records (sizes, digests) and values most ranks leave empty; lists that
        replicas share go through :meth:`all_gather_distinct_json`."""

    @abstractmethod
    def all_to_all_bytes(self, send: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        """Send ``send[r]`` (uint8) to rank r; receive ``recv_sizes[r]`` bytes from rank r.

        Sparse: only pairs with bytes to move exchange messages (both sides know the sizes from the plan),
        so the message count grows with the data, not with the square of the world size.
        """

    @abstractmethod
    def all_reduce_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of a few int64 ``values`` over all ranks (fixed size: an agreement)."""

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` on ``dst`` (None elsewhere); ``dst`` receives the sum of the payloads, the
        others nothing. Ranks with empty payloads send only their size."""
        sizes = self.gather_sizes(len(data), dst)
        send = [np.empty(0, np.uint8)] * self.world_size
        send[dst] = np.frombuffer(bytearray(data), dtype=np.uint8)
        recv = sizes if sizes is not None else [0] * self.world_size
        if self.rank == dst:
            recv = list(recv)
            recv[dst] = len(data)
        got = self.all_to_all_bytes(send, recv)
        return [g.tobytes() for g in got] if self.rank == dst else None

    def gather_with_values(
        self, values: Sequence[int], data: bytes, dst: int = 0
    ) -> tuple[np.ndarray, list[bytes]] | None:
        """Every rank's few int64 ``values`` (the same count on every rank) and its ``data`` on ``dst``: a
        (world size, len(values)) array and the payloads in rank order; None on the other ranks. One
        gather where the payloads are small (:meth:`TorchCommunicator.gather_with_values`); here the
        values ride in front of each payload."""
        k = len(values)
        raw = self.gather_bytes(np.asarray(values, dtype=np.int64).tobytes() + data, dst)
        if raw is None:
            return None
        rows = np.stack([np.frombuffer(b[: 8 * k], dtype=np.int64) for b in raw]).reshape(len(raw), k)
        return rows, [b[8 * k :] for b in raw]

    def gather_sizes(self, size: int, dst: int = 0) -> list[int] | None:
        """Every rank's ``size`` on ``dst`` (a fixed-size gather; 8 bytes per rank arrive at ``dst``)."""
        out = self.all_gather_bytes(int(size).to_bytes(8, "little"))
        return [int.from_bytes(b, "little") for b in out] if self.rank == dst else None

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``src``'s ``data`` on every rank."""
        return self.all_gather_bytes(data if self.rank == src else b"")[src]

    def scatter_bytes(self, data: Sequence[bytes] | None, src: int = 0) -> bytes:
        """``data[r]`` from ``src`` to each rank r: one size broadcast, then point-to-point messages."""
        payload = (
            [np.frombuffer(bytearray(d), dtype=np.uint8) for d in data] if self.rank == src and data else None
        )
        sizes = self.broadcast_bytes(
            np.asarray([len(p) for p in payload], dtype=np.int64).tobytes() if payload else None, src
        )
        mine = int(np.frombuffer(sizes, dtype=np.int64)[self.rank])
        send = payload if payload is not None else [np.empty(0, np.uint8)] * self.world_size
        recv = [mine if r == src else 0 for r in range(self.world_size)]
        return self.all_to_all_bytes(send, recv)[src].tobytes()

    def barrier(self) -> None:
        self.all_gather_bytes(b"")

    def set_liveness_timeout(self, timeout: float | None) -> None:  # noqa: B027 - optional, no-op by default
        """Seconds without progress from a peer after which a collective fails with
        :class:`~arraycheckpoint.errors.StalledRankError` naming it; None: this communicator's default.
        Called by the engine before a save's or load's first collective (the ``timeout=`` argument), with
        the same value on every rank. Communicators without liveness checks ignore it."""

    # JSON conveniences ------------------------------------------------------------------------------
    def all_gather_json(self, obj: Any) -> list[Any]:
        return [json.loads(b) for b in self.all_gather_bytes(_dumps(obj))]

    def gather_json(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out = self.gather_bytes(_dumps(obj), dst)
        return None if out is None else [json.loads(b) for b in out]

    def all_gather_distinct_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank, as :meth:`all_gather_json`, but each distinct value travels
        once: every rank sends a 16-byte digest, the first rank holding each value sends it to rank 0, which
        broadcasts the distinct values. Ranks that hold equal values (replicas) come back as one shared
        object. A rank receives a digest and a size per rank plus the distinct values, not world size x its
        value (an all-gather pads every payload to the longest)."""
        text = _dumps(obj)
        mine = hashlib.blake2b(text, digest_size=16).digest()
        first: dict[bytes, int] = {}
        holder = [first.setdefault(d, r) for r, d in enumerate(self.all_gather_bytes(mine))]
        holders = sorted(set(holder))
        sent = self.gather_bytes(text if holder[self.rank] == self.rank else b"", 0)
        blob = None if sent is None else b"[" + b",".join(sent[h] for h in holders) + b"]"
        parsed = dict(zip(holders, json.loads(self.broadcast_bytes(blob, 0)), strict=True))
        return [parsed[h] for h in holder]

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        return json.loads(self.broadcast_bytes(_dumps(obj) if self.rank == src else None, src))

    def scatter_json(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        data = [_dumps(o) for o in objs] if objs is not None and self.rank == src else None
        return json.loads(self.scatter_bytes(data, src))


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class SingleProcessCommunicator(Communicator):
    """The trivial communicator for one process: no process group, no copies."""

    def __init__(self) -> None:
        self._session = uuid.uuid4().hex[:12]

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def session_id(self) -> str:
        return self._session

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def all_to_all_bytes(self, send: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        return [np.asarray(send[0], dtype=np.uint8)]

    def all_reduce_min(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]


#: seconds between polls of a collective in flight for its first :data:`_FAST_POLL_FOR` seconds, and after
_FAST_POLL, _FAST_POLL_FOR, _SLOW_POLL = 0.001, 0.2, 0.02


class TorchCommunicator(Communicator):
    """Collectives on a dedicated gloo process group over the default torch.distributed world.

    Creating it is itself a collective (``new_group``): construct it on every rank at the same point, which
    :func:`default_communicator` does on the first save or load.
    """

    def __init__(
        self, group: Any = None, timeout: float | None = None, join_timeout: float | None = None
    ) -> None:
        """Args:
        group: the gloo group to use (default: a new one over the whole world, created once every rank got
            here: a rank that does not come within ``join_timeout``, default ``timeout``, is named in a
            :class:`StalledRankError`).
        timeout: seconds without a heartbeat after which a rank counts as stalled (default
            :data:`arraycheckpoint.runtime.liveness.DEFAULT_TIMEOUT` or ``ACP_LIVENESS_TIMEOUT``); every rank then
            fails within about this bound with an error naming the stalled rank. Only a whole-world group
            (the default) gets liveness checks and is rebuilt after a stall.
        """
        import torch
        import torch.distributed as dist

        from .liveness import Liveness, default_timeout, join_world

        self._dist = dist
        self._torch = torch
        self._own_group = group is None
        self._default_timeout = timeout or default_timeout()
        store = dist.distributed_c10d._get_default_store() if group is None else None
        if store is not None and dist.get_world_size() > 1:
            wait = join_timeout or self._default_timeout
            join_world(store, dist.get_rank(), dist.get_world_size(), wait, "the checkpoint group")
        self._group = group if group is not None else dist.new_group(backend="gloo")
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        self._liveness: Liveness | None = None
        self._broken: BaseException | None = None
        self._retired: list[Any] = []  # groups left with abandoned work: kept, their destructor could block
        token = uuid.uuid4().hex[:12] if self._rank == 0 else ""
        self._session = self.broadcast_bytes(token.encode()).decode()
        if store is not None:
            self._liveness = Liveness(
                store, f"acp-live/{self._session}", self._rank, self._world, self._default_timeout
            )
            self.barrier()  # every rank's first heartbeat exists before anyone checks

    def set_liveness_timeout(self, timeout: float | None) -> None:
        """See :meth:`Communicator.set_liveness_timeout` (heartbeats speed up at once for a short bound)."""
        if self._liveness is not None:
            self._liveness.set_timeout(timeout or self._default_timeout)
            if self._liveness.enter_call() and self._broken is None:
                from ..errors import StalledRankError

                self._broken = StalledRankError("a rank gave up a collective of this checkpoint group")

    def _call(self, start: Any, what: str) -> None:
        """Run one collective (``start()`` issues it with ``async_op=True``) and wait for it while checking
        liveness: a stalled peer raises :class:`~arraycheckpoint.runtime.liveness.StalledRankError` within the
        liveness timeout instead of blocking. After a stall the group is rebuilt at the next collective.
        """
        if self._liveness is None:
            start().wait()
            return
        from ..errors import StalledRankError

        if self._broken is not None:
            self._rebuild()
        work = None
        try:
            work = start()
            began = time.monotonic()
            delay = 1e-4
            while not work.is_completed():
                self._liveness.check(what)
                time.sleep(delay)
                # polled every millisecond at first (a checkpoint's collectives finish within milliseconds of
                # the last rank's arrival, and a doubling wait found them up to its own length late), then
                # every 20 ms: a rank waiting minutes for a slow peer wakes 50 times a second, not 1,000
                cap = _FAST_POLL if time.monotonic() - began < _FAST_POLL_FOR else _SLOW_POLL
                delay = min(delay * 2, cap)
            work.wait()
            self._liveness.check_abort(what)  # a stalled rank that resumed must not go on with stale data
        except StalledRankError as e:
            self._broken = e
            raise
        finally:
            if isinstance(work, _AllWorks) and not work.is_completed():
                work.abandon()  # nobody waits for it again: ended at interpreter exit

    def _rebuild(self) -> None:
        """After a stall: every rank agrees (through the store) and a fresh gloo group replaces the old one."""
        assert self._liveness is not None
        self._liveness.rebuild_barrier(self._liveness.generation + 1)
        self._retired.append(self._group)
        self._group = self._dist.new_group(backend="gloo")
        self._broken = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def session_id(self) -> str:
        return self._session

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        torch, dist = self._torch, self._dist
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self._world)]
        self._call(
            lambda: dist.all_gather(sizes, size, group=self._group, async_op=True), "a checkpoint all-gather"
        )
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        if longest == 0:
            return [b""] * self._world
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._world)]
        self._call(
            lambda: dist.all_gather(out, buf, group=self._group, async_op=True), "a checkpoint all-gather"
        )
        return [o[:n].numpy().tobytes() for o, n in zip(out, lengths)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        torch, dist = self._torch, self._dist
        size = torch.tensor([len(data) if data is not None and self._rank == src else 0], dtype=torch.int64)
        self._call(
            lambda: dist.broadcast(size, src=src, group=self._group, async_op=True), "a checkpoint broadcast"
        )
        n = int(size.item())
        buf = torch.empty(n, dtype=torch.uint8)
        if self._rank == src and n:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if n:
            self._call(
                lambda: dist.broadcast(buf, src=src, group=self._group, async_op=True),
                "a checkpoint broadcast",
            )
        return buf.numpy().tobytes()

    def all_to_all_bytes(self, send: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        torch, dist = self._torch, self._dist
        me = self._rank
        out: list[np.ndarray] = [np.empty(0, np.uint8)] * self._world
        ops = []
        keep = []
        for r in range(self._world):
            if r == me:
                out[r] = np.ascontiguousarray(send[r], dtype=np.uint8).ravel()
                continue
            if recv_sizes[r]:
                buf = torch.empty(int(recv_sizes[r]), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, buf, group=self._group, group_peer=r))
                out[r] = buf.numpy()
            data = send[r]
            if data.size:
                t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).ravel())
                keep.append(t)
                ops.append(dist.P2POp(dist.isend, t, group=self._group, group_peer=r))
        if ops:
            self._call(lambda: _AllWorks(dist.batch_isend_irecv(ops)), "the checkpoint fragment exchange")
        return out

    def all_reduce_min(self, values: Sequence[int]) -> list[int]:
        torch, dist = self._torch, self._dist
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self._call(
            lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group, async_op=True),
            "the checkpoint agreement",
        )
        return [int(v) for v in t.tolist()]

    def gather_with_values(
        self, values: Sequence[int], data: bytes, dst: int = 0
    ) -> tuple[np.ndarray, list[bytes]] | None:
        """See :meth:`Communicator.gather_with_values`: one ``gather`` of a fixed-size record per rank (the
        values, the payload's length and, in worlds of up to :data:`INLINE_WORLD` ranks, its first
        :data:`INLINE_BYTES` bytes), then point-to-point messages from the ranks whose payload did not fit
        (none in a save's commit at most sizes: a status is a few KB). ``dst`` receives at most
        world size x (8 x (len(values) + 1) + :data:`INLINE_BYTES`) bytes in the gather; the others nothing."""
        torch, dist = self._torch, self._dist
        k = len(values)
        inline = INLINE_BYTES if self._world <= INLINE_WORLD else 0  # the same on every rank
        record = np.zeros(8 * (k + 1) + inline, dtype=np.uint8)
        record[: 8 * (k + 1)] = np.frombuffer(
            np.asarray([*values, len(data)], dtype=np.int64).tobytes(), dtype=np.uint8
        )
        head = data[:inline] if len(data) <= inline else b""
        record[8 * (k + 1) : 8 * (k + 1) + len(head)] = np.frombuffer(head, dtype=np.uint8)
        t = torch.from_numpy(record)
        out = [torch.empty_like(t) for _ in range(self._world)] if self._rank == dst else None
        self._call(
            lambda: dist.gather(t, out, group=self._group, group_dst=dst, async_op=True),
            "the checkpoint status gather",
        )
        recs = np.stack([o.numpy() for o in out]) if out is not None else None
        rows = recs[:, : 8 * (k + 1)].copy().view(np.int64) if recs is not None else None
        # the payloads longer than the inline room travel point to point (both sides know which)
        send = [np.empty(0, np.uint8)] * self._world
        if self._rank != dst and len(data) > inline:
            send[dst] = np.frombuffer(bytearray(data), dtype=np.uint8)
        recv = [0] * self._world
        if rows is not None:
            recv = [int(n) if r != dst and n > inline else 0 for r, n in enumerate(rows[:, k])]
        big = self.all_to_all_bytes(send, recv)
        if rows is None or recs is None:
            return None
        payloads = []
        for r, n in enumerate(rows[:, k].tolist()):
            if r == dst:
                payloads.append(bytes(data))
            elif n > inline:
                payloads.append(big[r].tobytes())
            else:
                payloads.append(recs[r, 8 * (k + 1) : 8 * (k + 1) + n].tobytes())
        return rows[:, :k], payloads

    def gather_sizes(self, size: int, dst: int = 0) -> list[int] | None:
        torch, dist = self._torch, self._dist
        t = torch.tensor([int(size)], dtype=torch.int64)
        out = [torch.empty(1, dtype=torch.int64) for _ in range(self._world)] if self._rank == dst else None
        self._call(
            lambda: dist.gather(t, out, group=self._group, group_dst=dst, async_op=True),
            "the checkpoint size gather",
        )
        return [int(o.item()) for o in out] if out is not None else None


class _AllWorks:
    """Several pending point-to-point operations as one waitable, for the liveness-checked wait.

    gloo's point-to-point work objects report completion only through ``wait()`` (``is_completed()`` stays
    False), so a helper thread waits and the poll reads its flag. If a peer stalls, the collective is given up
    (:meth:`abandon`) and that thread stays blocked inside gloo; the group is rebuilt for the next collective,
    and the thread is ended when the interpreter exits (:func:`_end_abandoned`).
    """

    def __init__(self, works: list[Any]) -> None:
        self._works = works
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._at = 0  # the work the thread waits for now

        def wait_all() -> None:
            try:
                for i, w in enumerate(works):
                    self._at = i
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                self._error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=wait_all, name="acp-p2p-wait", daemon=True)
        self._thread.start()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Give up this collective (a peer stalled, or the caller was interrupted): its thread, still inside
        gloo's ``wait()``, is ended at interpreter exit."""
        _ABANDONED.difference_update([a for a in _ABANDONED if a.is_completed()])  # their peer did send
        _ABANDONED.add(self)
        if not _ABANDONED_HOOKED[0]:
            _ABANDONED_HOOKED[0] = True
            from .exithook import END_ABANDONED, at_thread_shutdown

            at_thread_shutdown(_end_abandoned, END_ABANDONED)

    def cancel(self) -> None:
        """Make the thread's pending ``wait()`` return (with an error). gloo offers no abort of a
        point-to-point operation (``ProcessGroupGloo.abort()`` and ``shutdown()`` leave it waiting); a wait
        with a timeout that expires closes every connection of the group's context, which fails the pending
        operations at once. Only for an abandoned collective: the group is unusable afterwards."""
        from datetime import timedelta

        for w in self._works[self._at :]:
            if self._done.is_set():
                return
            try:
                w.wait(timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001, S110 - the timeout is the point: the connections are closed now
                pass

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


#: collectives given up with their waiting thread still inside gloo (ended by :func:`_end_abandoned`)
_ABANDONED: set[_AllWorks] = set()
_ABANDONED_HOOKED = [False]
#: seconds the interpreter's exit waits in all for the threads of abandoned collectives to end
EXIT_JOIN_TIMEOUT = 5.0


def _end_abandoned() -> None:
    """End the waiting threads of abandoned point-to-point collectives before the interpreter finalizes.

    Such a thread blocks in gloo's ``wait()`` with the GIL released until its peer sends or its connection
    closes, which happens when that peer's process ends (killed with a stalled job, say) while this one
    finalizes: Python then ends the thread from inside torch's C++ binding and the process aborts (SIGABRT,
    "terminate called without an active exception") after the program itself returned. So each pending wait
    is cancelled (:meth:`_AllWorks.cancel`) and its thread waited for, at most :data:`EXIT_JOIN_TIMEOUT`
    seconds in all. Collectives in flight (an async save finishing at exit) are never abandoned, so never
    touched here.
    """
    pending = [a for a in _ABANDONED if not a.is_completed()]
    _ABANDONED.clear()
    for a in pending:
        a.cancel()
    deadline = time.monotonic() + EXIT_JOIN_TIMEOUT
    for a in pending:
        a.join(max(0.0, deadline - time.monotonic()))


#: :meth:`TorchCommunicator.gather_with_values` carries payloads of up to INLINE_BYTES in its one gather in
#: worlds of up to INLINE_WORLD ranks (the coordinator receives at most 1 MiB of padding); beyond, the
#: sampled ranks' statuses travel point to point after the fixed-size records
INLINE_BYTES, INLINE_WORLD = 16 << 10, 64

_TORCH_COMMS: dict[int, TorchCommunicator] = {}


def default_communicator(timeout: float | None = None) -> Communicator:
    """The communicator for this process: torch.distributed's world when initialised, else single-process.

    The torch one is created once per default process group and reused (its ``new_group`` is collective;
    ``timeout``: how long its creation waits for every rank, default the liveness timeout's default).
    """
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        key = id(dist.group.WORLD)
        if key not in _TORCH_COMMS:
            _TORCH_COMMS.clear()
            _TORCH_COMMS[key] = TorchCommunicator(join_timeout=timeout)
        return _TORCH_COMMS[key]
    return SingleProcessCommunicator()
