"""How long a save blocks on collecting the dataloader's state, with and without state prefetch.

The reference :class:`~arraycheckpoint.data.TokenBufferLoader` runs its reader thread ahead of training (up to
``--ready`` packed batches, ``--prefetch-tokens`` read ahead per worker), with a simulated per-sample read latency
(``--latency-ms``, I/O). At step ``S`` the training thread calls ``acp.save_async(path, {"dataloader": loader})``.

* **without prefetch** the loader must stop its reader at a consistent point (waiting for the sample read in
  progress) and copy its buffers plus the ready batches, in the training thread;
* **with prefetch** ``loader.prepare_checkpoint(S)`` was called a few steps earlier: the reader captured the
  state when it produced batch ``S``, and the save only polls a queue.

Measured per trial (median over ``--trials``): ``collect`` = ``loader.checkpoint_state(S)`` alone (what the save
calls), ``save_async`` = until ``save_async`` returns (the blocking part of a save of the loader alone).
Run::

    python benchmarks/bench_dataloader.py [--trials 15] [--latency-ms 2] [--workers 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import arraycheckpoint as acp
from arraycheckpoint.data import NumberedSource, TokenBufferLoader


def _loader(args: argparse.Namespace) -> TokenBufferLoader:
    sources = [
        NumberedSource(
            f"src{i}",
            10_000_000,
            ratio=1.0 + i,
            min_len=64,
            max_len=2048,
            read_latency_s=args.latency_ms / 1e3,
        )
        for i in range(3)
    ]
    return TokenBufferLoader(
        sources,
        seq_len=args.seq_len,
        num_workers=args.workers,
        prefetch_tokens=args.prefetch_tokens,
        max_ready_batches=args.ready,
    )


def _trial(args: argparse.Namespace, prefetch: bool, root: Path, i: int) -> tuple[float, float]:
    step = args.warmup
    times = []
    for what in ("collect", "save"):
        lo = _loader(args)
        for _ in range(step - args.ready - 3):
            next(lo)
        if prefetch:
            lo.prepare_checkpoint(step)
        while lo.consumed < step:
            next(lo)
        time.sleep(args.compute_ms / 1e3)  # a training step: the reader fills its queue meanwhile
        t0 = time.perf_counter()
        if what == "collect":
            lo.checkpoint_state(step)
            times.append(time.perf_counter() - t0)
        else:
            fut = acp.save_async(root / f"{prefetch}-{i}", {"dataloader": lo}, step=step)
            times.append(time.perf_counter() - t0)
            fut.result()
        lo.close()
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--latency-ms", type=float, default=2.0, help="simulated read latency per sample")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--prefetch-tokens", type=int, default=65536)
    p.add_argument("--ready", type=int, default=8, help="packed batches the reader keeps ready")
    p.add_argument("--warmup", type=int, default=20, help="the step that is saved")
    p.add_argument("--compute-ms", type=float, default=50.0, help="simulated training step before the save")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        _trial(args, True, root, -1)  # warm up imports, tensorstore, thread start
        res: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for i in range(args.trials):
            for prefetch in (False, True):
                res[prefetch].append(_trial(args, prefetch, root, i))
    med = {
        k: (statistics.median(c for c, _ in v), statistics.median(s for _, s in v)) for k, v in res.items()
    }
    state_mib = (args.workers * (args.prefetch_tokens + args.seq_len) + args.ready * args.seq_len) * 8 / 2**20
    print(
        f"reference TokenBufferLoader: {args.workers} workers, seq_len {args.seq_len}, {args.ready} ready batches, "
        f"read latency {args.latency_ms} ms/sample, ~{state_mib:.1f} MiB of buffered tokens; "
        f"median of {args.trials} trials"
    )
    print()
    print("| blocking time                 | without prefetch | with prefetch |  ratio |")
    print("|-------------------------------|-----------------:|--------------:|-------:|")
    for j, name in enumerate(("collect: checkpoint_state()", "save: save_async() returns")):
        a, b = med[False][j] * 1e3, med[True][j] * 1e3
        print(f"| {name:<29} | {a:>13.3f} ms | {b:>10.3f} ms | {a / max(b, 1e-9):>5.1f}x |")


if __name__ == "__main__":
    main()
