"""Collectives for multi-controller JAX over the coordination service's key-value store.

``jax.distributed.initialize`` starts a coordination service (gRPC) that every process is connected to; its
key-value store is how :class:`JaxCommunicator` moves checkpoint control messages and fragments. This is JAX's
own multi-controller facility (the same one ``multihost_utils`` and the preemption manager use), it needs no
device collective (so it never interleaves with training computations, and it is safe from the engine's
background thread), and it works on CPU, GPU and TPU alike.

Liveness: every blocking read of a key is a loop of short waits; between them the heartbeats of the rank that
owes the key (and, on rank 0, of every rank) are checked through the same store, as for the torch
communicator (:mod:`arraycheckpoint.runtime.liveness`). A process that stalls (stopped, frozen) makes every process
fail within the liveness bound (``timeout=`` of save/load, ``ACP_LIVENESS_TIMEOUT``, else 300 s) with a
:class:`~arraycheckpoint.errors.StalledRankError` naming it; a live but slow process is waited for. After a
stall the communicator starts a fresh key space for the next collective, once every process is back. The
coordination service runs in process 0: if process 0 itself stalls, the store stops answering and each
wait fails at the service's own deadline instead.

What it deliberately does not do: move bulk tensor data. The planner sends only fragments of chunks that
straddle ranks, which JAX's regular shardings rarely produce; values are split into parts of at most
:data:`PART_BYTES` so no single RPC grows large.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import ArrayCheckpointError, StalledRankError
from ...runtime.collectives import Communicator, SingleProcessCommunicator
from ...runtime.liveness import Liveness, default_timeout

PART_BYTES = 8 << 20
#: Bound of the one wait that precedes liveness (the session key, at construction).
DEFAULT_TIMEOUT_S = 1800.0


class JaxCommunicator(Communicator):
    """A :class:`Communicator` over ``jax.distributed``'s key-value store (one rank per JAX process).

    Every operation has a sequence number; rank ``r``'s contribution to operation ``n`` for rank ``d`` lives
    at ``arraycheckpoint/<session>/<n>/<r>/<d>``. Keys are deleted two operations later: finishing operation
    ``n + 1`` needs every rank's contribution to it, which a rank publishes only after reading all of ``n``.
    Construct it on every process at the same point (:func:`jax_communicator` does so once per process).
    """

    def __init__(self, client: Any = None, timeout_s: float | None = None) -> None:
        """Args:
        client: the ``jax.distributed`` client (default: this process's).
        timeout_s: liveness bound in seconds (default ``ACP_LIVENESS_TIMEOUT``, else 300 s); a save's or
            load's ``timeout=`` overrides it for that call.
        """
        import jax

        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        if client is None:
            raise ArrayCheckpointError(
                "jax runs with several processes but jax.distributed is not initialised on this process; call "
                "jax.distributed.initialize() before saving or loading"
            )
        self._client = client
        self._rank = jax.process_index()
        self._world = jax.process_count()
        self._timeout_ms = int(DEFAULT_TIMEOUT_S * 1000)
        self._default_timeout = timeout_s or default_timeout()
        self._seq = 0
        self._own: dict[int, list[str]] = {}
        # every rank has finished all collectives before this one (set after all-gathers and all-reduces, the
        # collectives that wait for every rank); only keys older than it are safe to delete, since after a
        # broadcast or gather the sending rank returns without waiting for the readers
        self._synced = 0
        self._lock = threading.Lock()
        self._broken: StalledRankError | None = None
        self._liveness: Liveness | None = None
        generation = _next_generation()
        key = f"arraycheckpoint/comm/{generation}"
        if self._rank == 0:
            client.key_value_set_bytes(key, uuid.uuid4().hex[:12].encode())
        self._session = self._get(key, 0).decode()
        self._base_session = self._session
        if self._world > 1:
            prefix = f"arraycheckpoint/live/{self._session}"
            store = _KvStore(client)
            self._liveness = Liveness(store, prefix, self._rank, self._world, self._default_timeout)

    def set_liveness_timeout(self, timeout: float | None) -> None:
        """See :meth:`Communicator.set_liveness_timeout`."""
        if self._liveness is not None:
            self._liveness.set_timeout(timeout or self._default_timeout)
            if self._liveness.enter_call() and self._broken is None:
                self._broken = StalledRankError("a rank gave up a collective of this checkpoint group")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def session_id(self) -> str:
        return self._session

    # --------------------------------------------------------------------------------------- primitives
    def _get(self, key: str, src: int) -> bytes:
        """The value of ``key``, which rank ``src`` publishes; waits while ``src`` is alive.

        Raises:
            StalledRankError: ``src`` (or, on rank 0, any rank) stopped beating for the liveness timeout,
                or another rank found a stalled one.
        """
        live = self._liveness
        while True:
            wait_ms = self._timeout_ms if live is None else max(10, int(live.interval * 1000))
            try:
                return bytes(self._client.blocking_key_value_get_bytes(key, wait_ms))
            except Exception as e:  # noqa: BLE001 - a short wait that ended, or a dead coordinator
                if live is None or "DEADLINE_EXCEEDED" not in str(e):
                    raise ArrayCheckpointError(
                        f"rank {self._rank}: waiting for {key!r} from JAX process {src} failed ({e}); a process "
                        "died, or the processes issued different save/load calls"
                    ) from e
            try:
                live.check(
                    f"a checkpoint collective (rank {self._rank} waiting for rank {src})", peers=(src,)
                )
            except StalledRankError as e:
                self._broken = e
                raise

    def _put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key`` as ``<key>/<i>`` parts plus a ``<key>/n`` count written last."""
        view = memoryview(data)
        parts = max(1, -(-len(view) // PART_BYTES))
        for i in range(parts):
            self._client.key_value_set_bytes(f"{key}/{i}", bytes(view[i * PART_BYTES : (i + 1) * PART_BYTES]))
        self._client.key_value_set_bytes(f"{key}/n", str(parts).encode())
        self._own.setdefault(self._seq, []).extend([f"{key}/{i}" for i in range(parts)] + [f"{key}/n"])

    def _fetch(self, key: str, src: int) -> bytes:
        parts = int(self._get(f"{key}/n", src))
        return b"".join(self._get(f"{key}/{i}", src) for i in range(parts))

    def _begin(self) -> str:
        if self._liveness is not None:
            if self._broken is not None:
                self._rebuild()
            try:  # a rank that stalled and resumed must not pair with the others' later collectives
                self._liveness.check_abort("a checkpoint collective")
            except StalledRankError as e:
                self._broken = e
                raise
        self._seq += 1
        for old in [s for s in self._own if s < self._synced]:
            for k in self._own.pop(old):
                try:
                    self._client.key_value_delete(k)
                except Exception:  # noqa: BLE001, S110 - cleanup only; the key expires with the service
                    pass
        return f"arraycheckpoint/{self._session}/{self._seq}"

    def _rebuild(self) -> None:
        """After a stall: once every rank is back (a store barrier), start a fresh key space."""
        assert self._liveness is not None
        generation = self._liveness.generation + 1
        self._liveness.rebuild_barrier(generation)
        for keys in self._own.values():
            for k in keys:
                try:
                    self._client.key_value_delete(k)
                except Exception:  # noqa: BLE001, S110 - cleanup only
                    pass
        self._own.clear()
        self._seq = self._synced = 0
        self._session = f"{self._base_session}.{generation}"
        self._broken = None

    # -------------------------------------------------------------------------------------- collectives
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        with self._lock:
            base = self._begin()
            self._put(f"{base}/{self._rank}/all", data)
            out = [data if r == self._rank else self._fetch(f"{base}/{r}/all", r) for r in range(self._world)]
            self._synced = self._seq  # every rank reached this collective, so finished the earlier ones
            return out

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        with self._lock:
            base = self._begin()
            if self._rank == src:
                self._put(f"{base}/bcast", data or b"")
                return data or b""
            return self._fetch(f"{base}/bcast", src)

    def all_reduce_min(self, values: Sequence[int]) -> list[int]:
        # reduce on rank 0 (N reads there), then one broadcast read per rank: never N reads on every rank
        with self._lock:
            base = self._begin()
            mine = np.asarray([int(v) for v in values], dtype=np.int64)
            if self._rank != 0:
                self._put(f"{base}/{self._rank}/min", mine.tobytes())
                out = np.frombuffer(self._fetch(f"{base}/min", 0), dtype=np.int64).tolist()
            else:
                for r in range(1, self._world):
                    mine = np.minimum(mine, np.frombuffer(self._fetch(f"{base}/{r}/min", r), dtype=np.int64))
                self._put(f"{base}/min", mine.tobytes())
                out = mine.tolist()
            self._synced = self._seq  # rank 0 heard from every rank here: all finished the earlier ones
            return out

    def gather_sizes(self, size: int, dst: int = 0) -> list[int] | None:
        with self._lock:
            base = self._begin()
            if self._rank != dst:
                self._put(f"{base}/{self._rank}/size", int(size).to_bytes(8, "little"))
                return None
            return [
                int(size) if r == dst else int.from_bytes(self._fetch(f"{base}/{r}/size", r), "little")
                for r in range(self._world)
            ]

    def all_to_all_bytes(self, send: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        # sparse: keys only for the pairs with bytes to move (both sides know the sizes from the plan)
        with self._lock:
            base = self._begin()
            for dst in range(self._world):
                if dst != self._rank and send[dst].size:
                    self._put(
                        f"{base}/{self._rank}/{dst}", np.ascontiguousarray(send[dst], dtype=np.uint8).data
                    )
            out = []
            for src in range(self._world):
                if src == self._rank:
                    out.append(np.ascontiguousarray(send[src], dtype=np.uint8).ravel())
                    continue
                if not recv_sizes[src]:
                    out.append(np.empty(0, np.uint8))
                    continue
                got = np.frombuffer(self._fetch(f"{base}/{src}/{self._rank}", src), dtype=np.uint8)
                if got.size != recv_sizes[src]:
                    raise ArrayCheckpointError(
                        f"rank {self._rank}: expected {recv_sizes[src]} bytes from rank {src}, got {got.size}"
                    )
                out.append(got)
            return out


class _KvStore:
    """The coordination service's key-value store in the shape :class:`~arraycheckpoint.runtime.liveness.Liveness`
    uses (the subset of ``torch.distributed.Store`` it needs)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str) -> bytes:
        return bytes(self._client.key_value_try_get_bytes(key))

    def check(self, keys: list[str]) -> bool:
        try:
            for key in keys:
                self._client.key_value_try_get_bytes(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return False
        return True

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Values of ``keys`` (b"" for one not written yet). Many keys (rank 0 watching every rank): one
        directory read per directory instead of one request per rank; a few keys (the other ranks watch
        one or two): one small read each, never the whole directory (O(world) bytes)."""
        if len(keys) > 8:
            found: dict[str, bytes] = {}
            for directory in {k.rsplit("/", 1)[0] for k in keys}:
                found.update((k, bytes(v)) for k, v in self._client.key_value_dir_get_bytes(directory + "/"))
            return [found.get(k, b"") for k in keys]
        out = []
        for key in keys:
            try:
                out.append(bytes(self._client.key_value_try_get_bytes(key)))
            except Exception:  # noqa: BLE001 - not yet written: a value that has not moved
                out.append(b"")
        return out

    def add(self, key: str, amount: int) -> int:
        return int(self._client.key_value_increment(key, amount))


_GENERATION = [0]
_COMMS: dict[tuple[int, int], Communicator] = {}


def _next_generation() -> int:
    _GENERATION[0] += 1
    return _GENERATION[0]


def jax_communicator() -> Communicator:
    """The communicator for this JAX process group.

    One process: a :class:`SingleProcessCommunicator`. Several (``jax.distributed.initialize`` was called):
    a :class:`JaxCommunicator`, created once per process and reused (its creation is collective).
    """
    import jax

    if jax.process_count() == 1:
        return SingleProcessCommunicator()
    key = (jax.process_count(), jax.process_index())
    comm = _COMMS.get(key)
    if comm is None:
        comm = _COMMS[key] = JaxCommunicator()
    return comm
