"""The Communicator seam: every collective arraycheckpoint runs goes through one of these.

Objects travel as JSON (never pickle); bulk fragments travel as raw byte buffers in one batched all-to-all.
Implementations: :class:`SingleProcessCommunicator` (no process group at all), :class:`TorchCommunicator`
(a dedicated gloo group created once, never the training group, so background checkpoint collectives cannot
interleave with training collectives), and the JAX multi-controller one in ``adapters.jax``.
Only the engine calls these, from one thread per process, in the same order on every rank.
"""

from __future__ import annotations

import json
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
        """Every rank's ``data``, in rank order, on every rank."""

    @abstractmethod
    def all_to_all_bytes(self, send: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        """Send ``send[r]`` (uint8) to rank r; receive ``recv_sizes[r]`` bytes from rank r. One batched call."""

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` on ``dst`` (None elsewhere). Defaults to an all-gather."""
        out = self.all_gather_bytes(data)
        return out if self.rank == dst else None

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``src``'s ``data`` on every rank."""
        return self.all_gather_bytes(data if self.rank == src else b"")[src]

    def scatter_bytes(self, data: Sequence[bytes] | None, src: int = 0) -> bytes:
        """``data[r]`` from ``src`` to each rank r, through the batched all-to-all."""
        payload = [np.frombuffer(d, dtype=np.uint8) for d in data] if self.rank == src and data else None
        sizes = self.broadcast_bytes(json.dumps([len(p) for p in payload]).encode() if payload else None, src)
        mine = json.loads(sizes)
        send = payload if payload is not None else [np.empty(0, np.uint8)] * self.world_size
        recv = [mine[self.rank] if r == src else 0 for r in range(self.world_size)]
        return self.all_to_all_bytes(send, recv)[src].tobytes()

    def barrier(self) -> None:
        self.all_gather_bytes(b"")

    # JSON conveniences ------------------------------------------------------------------------------
    def all_gather_json(self, obj: Any) -> list[Any]:
        return [json.loads(b) for b in self.all_gather_bytes(_dumps(obj))]

    def gather_json(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out = self.gather_bytes(_dumps(obj), dst)
        return None if out is None else [json.loads(b) for b in out]

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


class TorchCommunicator(Communicator):
    """Collectives on a dedicated gloo process group over the default torch.distributed world.

    Creating it is itself a collective (``new_group``): construct it on every rank at the same point, which
    :func:`default_communicator` does on the first save or load.
    """

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        """Args:
        group: the gloo group to use (default: a new one over the whole world).
        timeout: seconds without a heartbeat after which a rank counts as stalled (default
            :data:`arraycheckpoint.liveness.DEFAULT_TIMEOUT` or ``ACP_LIVENESS_TIMEOUT``); every rank then
            fails within about this bound with an error naming the stalled rank. Only a whole-world group
            (the default) gets liveness checks and is rebuilt after a stall.
        """
        import torch
        import torch.distributed as dist

        from .liveness import Liveness, default_timeout

        self._dist = dist
        self._torch = torch
        self._own_group = group is None
        self._group = group if group is not None else dist.new_group(backend="gloo")
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        self._liveness: Liveness | None = None
        self._broken: BaseException | None = None
        self._retired: list[Any] = []  # groups left with abandoned work: kept, their destructor could block
        token = uuid.uuid4().hex[:12] if self._rank == 0 else ""
        self._session = self.broadcast_bytes(token.encode()).decode()
        store = dist.distributed_c10d._get_default_store() if self._own_group else None
        if store is not None:
            self._liveness = Liveness(
                store, f"acp-live/{self._session}", self._rank, self._world, timeout or default_timeout()
            )
            self.barrier()  # every rank's first heartbeat exists before anyone checks

    def _call(self, start: Any, what: str) -> None:
        """Run one collective (``start()`` issues it with ``async_op=True``) and wait for it while checking
        liveness: a stalled peer raises :class:`~arraycheckpoint.liveness.StalledRankError` within the
        liveness timeout instead of blocking. After a stall the group is rebuilt at the next collective.
        """
        if self._liveness is None:
            start().wait()
            return
        from .liveness import StalledRankError

        if self._broken is not None:
            self._rebuild()
        try:
            work = start()
            delay = 1e-4
            while not work.is_completed():
                self._liveness.check(what)
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
            work.wait()
            self._liveness.check_abort(what)  # a stalled rank that resumed must not go on with stale data
        except StalledRankError as e:
            self._broken = e
            raise

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
        send_sizes = [int(s.size) for s in send]
        flat = (
            np.concatenate([np.asarray(s, dtype=np.uint8).ravel() for s in send]) if sum(send_sizes) else None
        )
        inp = torch.from_numpy(flat) if flat is not None else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        self._call(
            lambda: dist.all_to_all_single(
                out, inp, list(recv_sizes), send_sizes, group=self._group, async_op=True
            ),
            "the checkpoint all-to-all",
        )
        arr = out.numpy()
        bounds = np.cumsum([0, *recv_sizes])
        return [arr[bounds[r] : bounds[r + 1]] for r in range(self._world)]


_TORCH_COMMS: dict[int, TorchCommunicator] = {}


def default_communicator() -> Communicator:
    """The communicator for this process: torch.distributed's world when initialised, else single-process.

    The torch one is created once per default process group and reused (its ``new_group`` is collective).
    """
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        key = id(dist.group.WORLD)
        if key not in _TORCH_COMMS:
            _TORCH_COMMS.clear()
            _TORCH_COMMS[key] = TorchCommunicator()
        return _TORCH_COMMS[key]
    return SingleProcessCommunicator()
