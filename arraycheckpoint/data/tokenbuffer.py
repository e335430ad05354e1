"""A reference resumable token-buffer dataloader that implements :class:`~arraycheckpoint.data.ReshardableLoader`.

Data: one or more :class:`NumberedSource` s, each a deterministic sequence of numbered samples (variable-length
token sequences whose tokens encode ``(source, sample, position)``, see :func:`decode_tokens`). Layout: DP rank
``dp_rank`` of ``dp_size``, with ``num_workers`` reader workers; the ``K = dp_size * num_workers`` shards
start with contiguous blocks of every source. Each worker mixes its sources by ``ratio`` (smooth weighted
round-robin), packs samples into ``seq_len``-token batches through a token buffer (leftover tokens of a sample
stay buffered for the next batch, plus ``prefetch_tokens`` read ahead), and a reader thread keeps up to
``max_ready_batches`` packed batches ready. Batches are taken from workers round-robin.

Everything read but not yet returned by ``next()`` (ready batches, buffered tokens) is part of the checkpoint
state, so a resumed run returns exactly the batches an uninterrupted run would (same layout), and a
resharded run returns every remaining token exactly once (see :mod:`arraycheckpoint.data.reshard`).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArrayCheckpointError
from .protocol import LoaderState, SavedLoaderState, ShardKey, ShardState
from .reshard import Range, buffer_owner, split_ranges

_SAMPLE_BITS = 24
_POS_BITS = 16


def encode_token(source: int, sample: int, pos: int) -> int:
    """The token value of position ``pos`` of sample ``sample`` of source ``source``."""
    return ((source << _SAMPLE_BITS | sample) << _POS_BITS) | pos


def decode_tokens(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(source, sample, pos)`` arrays of reference-loader tokens."""
    t = np.asarray(tokens, dtype=np.int64)
    return (
        t >> (_SAMPLE_BITS + _POS_BITS),
        (t >> _POS_BITS) & ((1 << _SAMPLE_BITS) - 1),
        t & ((1 << _POS_BITS) - 1),
    )


@dataclass(frozen=True)
class NumberedSource:
    """A deterministic data source: sample ``i`` has ``length(i)`` tokens ``encode_token(index, i, 0..)``.

    ``path`` names the source (in a real loader: a file or dataset path); ``ratio`` is its sampling weight;
    ``read_latency_s`` simulates I/O time per sample read.
    """

    path: str
    num_samples: int
    ratio: float = 1.0
    min_len: int = 1
    max_len: int = 16
    read_latency_s: float = 0.0

    def length(self, i: int) -> int:
        span = self.max_len - self.min_len + 1
        h = (i * 2654435761 + len(self.path) * 40503 + sum(map(ord, self.path))) & 0xFFFFFFFF
        return self.min_len + h % span

    def read(self, index: int, i: int) -> np.ndarray:
        """The tokens of sample ``i`` (this source being number ``index`` of the loader)."""
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        base = encode_token(index, i, 0)
        return np.arange(base, base + self.length(i), dtype=np.int64)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_samples": self.num_samples,
            "ratio": self.ratio,
            "min_len": self.min_len,
            "max_len": self.max_len,
        }

    def all_tokens(self, index: int) -> np.ndarray:
        """Every token of the source (for tests: the multiset a full epoch must produce)."""
        return (
            np.concatenate([self.read_fast(index, i) for i in range(self.num_samples)])
            if self.num_samples
            else np.empty(0, np.int64)
        )

    def read_fast(self, index: int, i: int) -> np.ndarray:
        base = encode_token(index, i, 0)
        return np.arange(base, base + self.length(i), dtype=np.int64)


class _Worker:
    """One reader worker's shard: remaining index ranges per source, mixing credits and the token buffer."""

    def __init__(self, ranges: list[list[Range]], credits: list[float], buffer: np.ndarray) -> None:
        self.ranges = [deque((int(b), int(e)) for b, e in r if e > b) for r in ranges]
        self.credits = list(credits)
        self.chunks: deque[np.ndarray] = deque([buffer] if buffer.size else [])
        self.buffered = int(buffer.size)

    def has_data(self) -> bool:
        return self.buffered > 0 or any(self.ranges)

    def _read_one(self, sources: Sequence[NumberedSource]) -> None:
        active = [s for s, r in enumerate(self.ranges) if r]
        total = sum(sources[s].ratio for s in active)
        for s in active:
            self.credits[s] += sources[s].ratio
        best = max(active, key=lambda s: (self.credits[s], -s))
        self.credits[best] -= total
        b, e = self.ranges[best][0]
        if b + 1 == e:
            self.ranges[best].popleft()
        else:
            self.ranges[best][0] = (b + 1, e)
        tokens = sources[best].read(best, b)
        self.chunks.append(tokens)
        self.buffered += tokens.size

    def next_batch(self, sources: Sequence[NumberedSource], seq_len: int, prefetch_tokens: int) -> np.ndarray:
        while self.buffered < seq_len + prefetch_tokens and any(self.ranges):
            self._read_one(sources)
        take = min(seq_len, self.buffered)
        parts, need = [], take
        while need:
            c = self.chunks[0]
            if c.size <= need:
                parts.append(self.chunks.popleft())
                need -= c.size
            else:
                parts.append(c[:need])
                self.chunks[0] = c[need:]
                need = 0
        self.buffered -= take
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def state(self, ready: Sequence[np.ndarray] = ()) -> ShardState:
        buf = np.concatenate([*ready, *self.chunks]) if (ready or self.chunks) else np.empty(0, np.int64)
        return ShardState(
            meta={"ranges": [[list(x) for x in r] for r in self.ranges], "credits": list(self.credits)},
            arrays={"buffer": buf.astype(np.int64, copy=True)},
        )


class TokenBufferLoader:
    """The reference resumable, reshardable token-buffer loader (an iterator of int64 token batches).

    Args:
        sources: the data sources (their order is part of the replicated state).
        seq_len: tokens per batch (the last batch of a worker may be shorter).
        dp_rank, dp_size: this rank's data-parallel position.
        num_workers: reader workers (shards) per DP rank.
        prefetch_tokens: tokens each worker reads ahead beyond the current batch.
        max_ready_batches: packed batches the reader keeps ready.
        background: read in a background thread (``False``: read inside ``next()``).

    Example:
        >>> loader = TokenBufferLoader([NumberedSource("a", 1000)], seq_len=64, dp_rank=r, dp_size=n)
        >>> batch = next(loader)
        >>> loader.prepare_checkpoint(100)          # optional: state at step 100 is captured off-thread
        >>> acp.save(path, {"model": model, "dataloader": loader}, step=100)
    """

    def __init__(
        self,
        sources: Sequence[NumberedSource],
        *,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        num_workers: int = 1,
        prefetch_tokens: int = 0,
        max_ready_batches: int = 4,
        background: bool = True,
    ) -> None:
        if not 0 <= dp_rank < dp_size or num_workers < 1 or seq_len < 1:
            raise ValueError(
                f"bad layout: dp_rank={dp_rank} dp_size={dp_size} num_workers={num_workers} seq_len={seq_len}"
            )
        self.sources = list(sources)
        self.seq_len = seq_len
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.prefetch_tokens = prefetch_tokens
        self.max_ready_batches = max(1, max_ready_batches)
        self.background = background
        self._state_lock = threading.Lock()  # held by the reader for each step, and by slow-path snapshots
        self._cv = threading.Condition()  # guards the ready deque and counters
        self._thread: threading.Thread | None = None
        self._closed = False
        self._prepared: queue.Queue[tuple[int, LoaderState]] = queue.Queue()
        self._target: int | None = None
        self._reset(self._fresh_workers(), rr=0, consumed=0)

    # ----------------------------------------------------------------------------------------- layout
    def _fresh_workers(self) -> list[_Worker]:
        parts = self.dp_size * self.num_workers
        pieces = [split_ranges([(0, s.num_samples)], parts) for s in self.sources]
        first = self.dp_rank * self.num_workers
        return [
            _Worker(
                [pieces[s][first + w] for s in range(len(self.sources))],
                [0.0] * len(self.sources),
                np.empty(0, np.int64),
            )
            for w in range(self.num_workers)
        ]

    def _reset(self, workers: list[_Worker], rr: int, consumed: int) -> None:
        self._stop_reader()
        self._workers = workers
        self._rr = rr
        self._ready: deque[tuple[int, np.ndarray]] = deque()
        self._produced = consumed
        self._consumed = consumed
        self._done = False
        self._closed = False
        self._target = None
        self._prepared = queue.Queue()

    def replicated_state(self) -> dict[str, Any]:
        """The part every rank shares: sources (paths, sizes, ratios), worker count, sequence length."""
        return {
            "kind": "TokenBufferLoader",
            "sources": [s.to_json() for s in self.sources],
            "num_workers": self.num_workers,
            "seq_len": self.seq_len,
        }

    # -------------------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        if self.background and self._thread is None and not self._done:
            self._thread = threading.Thread(target=self._reader, name="acp-tokenbuffer-reader", daemon=True)
            self._thread.start()
            _stop_at_exit(self)
        if not self.background:
            with self._cv:
                empty = not self._ready
            if empty:
                with self._state_lock:
                    self._reader_step()
        with self._cv:
            while not self._ready and not self._done:
                self._cv.wait()
            if not self._ready:
                raise StopIteration
            _w, batch = self._ready.popleft()
            self._consumed += 1
            self._cv.notify_all()
            return batch

    @property
    def consumed(self) -> int:
        """Batches returned by ``next()`` (including those of the run this state was loaded from)."""
        return self._consumed

    def _reader(self) -> None:
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= self.max_ready_batches:
                    self._cv.wait()
                if self._closed:
                    return
            with self._state_lock:
                if self._closed or not self._reader_step():
                    return

    def _reader_step(self) -> bool:
        """Produce one batch (caller holds the state lock). False when every worker is exhausted."""
        n = self.num_workers
        w = next((x % n for x in range(self._rr, self._rr + n) if self._workers[x % n].has_data()), None)
        if w is None:
            with self._cv:
                self._done = True
                self._cv.notify_all()
            return False
        batch = self._workers[w].next_batch(self.sources, self.seq_len, self.prefetch_tokens)
        self._rr = (w + 1) % n
        produced = self._produced + 1
        if self._target == produced:  # before the batch is visible: the state is ready when it is consumed
            self._prepared.put((produced, self._state(ready=(), rr=self._rr, consumed=produced)))
        with self._cv:
            self._ready.append((w, batch))
            self._produced = produced
            self._cv.notify_all()
        return True

    def _stop_reader(self) -> None:
        if self._thread is not None:
            self._tell_reader_to_stop()
            self._thread.join()
        self._thread = None

    def close(self) -> None:
        """Stop the reader thread (the state stays as it is)."""
        self._stop_reader()

    def _tell_reader_to_stop(self) -> threading.Thread | None:
        """Ask the reader to end after its current step (the exit hook); returns it (None: not running)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return self._thread

    # ------------------------------------------------------------------------------------- checkpoint
    def prepare_checkpoint(self, step: int) -> None:
        """Capture the state when ``step`` batches have been consumed, in the reader (off the training thread).

        Call it before the reader has produced batch ``step`` (e.g. a few steps ahead of the save); later,
        :meth:`checkpoint_state` falls back to a synchronous snapshot.
        """
        with self._state_lock:
            if step > self._produced:
                self._target = step
            elif step == self._consumed == self._produced:
                self._prepared.put((step, self._state(ready=(), rr=self._rr, consumed=step)))

    def checkpoint_state(self, step: int | None = None) -> LoaderState:
        """This rank's state now: a prepared one for ``step`` (a queue poll) or a synchronous snapshot."""
        if step is not None:
            while True:
                try:
                    at, state = self._prepared.get_nowait()
                except queue.Empty:
                    break
                if at == step and self._consumed == step:
                    return state
        with self._state_lock, self._cv:
            ready: dict[int, list[np.ndarray]] = {}
            for w, b in self._ready:
                ready.setdefault(w, []).append(b)
            rr = self._ready[0][0] if self._ready else self._rr
            return self._state(ready=ready, rr=rr, consumed=self._consumed)

    def _state(self, ready: Any, rr: int, consumed: int) -> LoaderState:
        loader = {"rr": rr, "consumed": consumed}
        shards: dict[ShardKey, ShardState] = {}
        for w, worker in enumerate(self._workers):
            st = worker.state(ready.get(w, []) if ready else ())
            st.meta["loader"] = loader
            shards[(self.dp_rank, w)] = st
        return LoaderState(
            self.replicated_state(), self.dp_rank, self.dp_size, self.num_workers, shards, consumed
        )

    def _same_layout(self, saved: SavedLoaderState) -> bool:
        return saved.dp_size == self.dp_size and saved.num_workers == self.num_workers

    def shards_to_load(self, saved: SavedLoaderState) -> list[ShardKey]:
        """Own shards under an unchanged layout; else the saved shards whose buffers move to this rank."""
        self._check_replicated(saved)
        if self._same_layout(saved):
            return [(self.dp_rank, w) for w in range(self.num_workers)]
        parts = self.dp_size * self.num_workers
        mine = range(self.dp_rank * self.num_workers, (self.dp_rank + 1) * self.num_workers)
        return [k for k in saved.ordered_keys() if buffer_owner(saved.flat_index(k), parts) in mine]

    def load_checkpoint_state(self, saved: SavedLoaderState) -> None:
        """Resume from ``saved``: exactly (same layout) or merged/split (see :mod:`..data.reshard`)."""
        self._check_replicated(saved)
        nsrc = len(self.sources)
        if self._same_layout(saved):
            workers = []
            for w in range(self.num_workers):
                st = saved.shards.get((self.dp_rank, w))
                if st is None:
                    raise ArrayCheckpointError(
                        f"dataloader: the checkpoint has no shard for dp rank {self.dp_rank} "
                        f"worker {w}; was it saved by every DP rank?"
                    )
                workers.append(_Worker(st.meta["ranges"], st.meta["credits"], st.arrays["buffer"]))
            loader = saved.shards[(self.dp_rank, 0)].meta["loader"]
            self._reset(workers, rr=int(loader["rr"]), consumed=int(loader["consumed"]))
            return
        keys = saved.ordered_keys()
        expected = saved.dp_size * saved.num_workers
        if len(keys) != expected:
            raise ArrayCheckpointError(
                f"dataloader: the checkpoint has {len(keys)} shards, its layout needs "
                f"{expected} (dp_size {saved.dp_size} x {saved.num_workers} workers)"
            )
        parts = self.dp_size * self.num_workers
        pooled = [[r for k in keys for r in saved.shards[k].meta["ranges"][s]] for s in range(nsrc)]
        pieces = [split_ranges(p, parts) for p in pooled]
        workers = []
        for w in range(self.num_workers):
            j = self.dp_rank * self.num_workers + w
            bufs = [
                saved.shards[k].arrays["buffer"]
                for k in keys
                if buffer_owner(saved.flat_index(k), parts) == j
            ]
            buf = np.concatenate(bufs).astype(np.int64) if bufs else np.empty(0, np.int64)
            workers.append(_Worker([pieces[s][j] for s in range(nsrc)], [0.0] * nsrc, buf))
        self._reset(workers, rr=0, consumed=int(saved.step or 0))

    def _check_replicated(self, saved: SavedLoaderState) -> None:
        mine = self.replicated_state()
        theirs = saved.replicated
        if theirs.get("sources") != mine["sources"] or theirs.get("seq_len") != mine["seq_len"]:
            raise ArrayCheckpointError(
                "dataloader: the checkpoint's sources/seq_len differ from this loader's "
                f"(saved {theirs.get('sources')}, seq_len {theirs.get('seq_len')}; here {mine['sources']}, "
                f"seq_len {mine['seq_len']}); build the loader with the saved sources to resume"
            )


#: seconds the interpreter's exit waits in all for reader threads to finish the step they are in
EXIT_JOIN_TIMEOUT = 5.0
_READING: weakref.WeakSet[TokenBufferLoader] = weakref.WeakSet()
_HOOKED = [False]


def _forget_in_child() -> None:
    """A forked child has none of its parent's reader threads (and a loader's lock may have been held by one
    at the fork): its exit does not touch them."""
    global _READING
    _READING = weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _stop_at_exit(loader: TokenBufferLoader) -> None:
    """Have ``loader``'s reader stopped by :func:`_stop_readers` when the interpreter exits."""
    _READING.add(loader)
    if not _HOOKED[0]:
        _HOOKED[0] = True
        atexit.register(_stop_readers)


def _stop_readers() -> None:
    """Stop the reader threads of loaders never closed, before the interpreter finalizes (an ``atexit`` hook).

    A reader reads ahead until ``max_ready_batches`` are ready, so a script that stops iterating early leaves
    it reading. A daemon thread that comes back from a call that released the GIL while the interpreter
    finalizes is ended by Python from where it stands: inside a C++ library (a source whose ``read`` goes
    through torch, tensorstore, a cloud SDK) that aborts the process (SIGABRT, "terminate called without an
    active exception") after the program itself succeeded. So each reader is told to stop after its current
    step and waited for, at most :data:`EXIT_JOIN_TIMEOUT` seconds in all (a read stuck longer is left).
    ``atexit`` runs after Python has joined the non-daemon threads, which may still be iterating a loader.
    """
    threads = [t for t in (loader._tell_reader_to_stop() for loader in list(_READING)) if t is not None]
    deadline = time.monotonic() + EXIT_JOIN_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
