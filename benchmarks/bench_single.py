"""Single-process save/load of a ~1 GiB training state: arraycheckpoint against the usual anchors.

The state has a few large tensors and many small ones, float32 and bfloat16 (by default 4 x 192 MiB + 300 small
tensors of ~0.85 MiB on average: 1 GiB). Methods, all on the same state and directory:

* ``arraycheckpoint``: ``acp.save`` / ``acp.load`` into preallocated tensors; ``acp.save_async`` blocking time
  (until ``fut.staged`` completes);
* ``torch.save`` / ``torch.load(weights_only=True)``, then copied into the preallocated tensors;
* ``safetensors``: ``safetensors.torch.save_file`` / ``load_file``, then copied likewise;
* ``DCP``: ``torch.distributed.checkpoint.save`` / ``load`` (in place) with no process group, and
  ``dcp.async_save`` blocking time (until it returns);
* ``raw numpy``: every tensor's bytes ``tofile``'d into one file, loaded with ``np.fromfile`` and copied;
* ``memcpy``: ``copy_`` of every tensor into preallocated tensors (the floor of any snapshot).

Every save is timed until ``os.sync()`` returns; loads are timed warm (page cache as the save left it) and,
where this process may drop the page cache (root), cold (cache dropped before every load of every method).
Each number is the median of ``--repeats`` rounds after one warm-up round. Run::

    python benchmarks/bench_single.py                  # 1 GiB, 3 rounds
    python benchmarks/bench_single.py --size-mib 128   # quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MiB,
    can_drop_page_cache,
    drop_page_cache,
    fmt_ratio,
    fmt_seconds,
    machine_description,
    markdown_table,
    median,
    peak_rss_mib,
    ratio,
    remove,
    stopwatch,
    sync,
    tree_bytes,
    verdict,
)

State = dict[str, torch.Tensor]

N_LARGE = 4
N_SMALL = 300


def make_state(size_mib: float, seed: int = 0) -> State:
    """A state of ``size_mib``: 4 large tensors (3/4 of the bytes) and 300 small ones, float32 and bfloat16."""
    g = torch.Generator().manual_seed(seed)
    state: State = {}
    large_bytes = int(size_mib * MiB * 3 / 4 / N_LARGE)
    for i in range(N_LARGE):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        n = large_bytes // dtype.itemsize
        cols = 1024
        state[f"layers.{i}.mlp.weight"] = torch.randn(n // cols, cols, generator=g).to(dtype)
    small_bytes = size_mib * MiB / 4 / N_SMALL
    for i in range(N_SMALL):
        dtype = torch.float32 if i % 3 else torch.bfloat16
        n = max(1, int(small_bytes * (0.5 + (i % 5) / 4)) // dtype.itemsize)
        if i % 3 == 0:
            shape: tuple[int, ...] = (n,)
        else:
            cols = 256
            shape = (max(1, n // cols), cols)
        state[f"blocks.{i // 6}.p{i % 6}"] = torch.randn(shape, generator=g).to(dtype)
    return state


def empty_like(state: State) -> State:
    """Preallocated tensors of the same shapes and dtypes, filled with garbage (touched, so no page faults)."""
    return {k: torch.full_like(v, -1) for k, v in state.items()}


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same(a: State, b: State) -> bool:
    """Bit-exact equality of two states (same keys, dtypes, shapes and bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


# ---------------------------------------------------------------------------------------------- methods
@dataclass
class Method:
    """A save/load pair; ``load`` returns the loaded state (for the correctness check)."""

    name: str
    save: Callable[[str, State], None]
    load: Callable[[str, State, State], State]  # (path, source for metadata, preallocated target)
    suffix: str = ""


def _acp_save(path: str, state: State) -> None:
    import arraycheckpoint as acp

    acp.save(path, {"model": state})


def _acp_load(path: str, state: State, target: State) -> State:
    import arraycheckpoint as acp

    acp.load(path, {"model": target})
    return target


def _torch_save(path: str, state: State) -> None:
    torch.save(state, path)


def _into(target: State, loaded: State) -> State:
    """Copy freshly loaded tensors into the preallocated model (what ``load_state_dict`` does)."""
    for k, v in loaded.items():
        target[k].copy_(v)
    return target


def _torch_load(path: str, state: State, target: State) -> State:
    return _into(target, torch.load(path, weights_only=True))


def _st_save(path: str, state: State) -> None:
    from safetensors.torch import save_file

    save_file(state, path)


def _st_load(path: str, state: State, target: State) -> State:
    from safetensors.torch import load_file

    return _into(target, load_file(path))


def _dcp_save(path: str, state: State) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)


def _dcp_load(path: str, state: State, target: State) -> State:
    import torch.distributed.checkpoint as dcp

    dcp.load(target, checkpoint_id=path)
    return target


def _raw_bits(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` as a numpy array (bfloat16 through an int16 view)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _raw_save(path: str, state: State) -> None:
    with open(path, "wb") as f:
        for t in state.values():
            _raw_bits(t).tofile(f)


def _raw_load(path: str, state: State, target: State) -> State:
    offset = 0
    for k, t in state.items():
        dtype = (
            np.dtype(np.int16) if t.dtype == torch.bfloat16 else torch.empty(0, dtype=t.dtype).numpy().dtype
        )
        arr = np.fromfile(path, dtype=dtype, count=t.numel(), offset=offset)
        x = torch.from_numpy(arr).view(t.dtype).reshape(t.shape)
        target[k].copy_(x)
        offset += arr.nbytes
    return target


METHODS = [
    Method("arraycheckpoint", _acp_save, _acp_load),
    Method("torch.save", _torch_save, _torch_load, ".pt"),
    Method("safetensors", _st_save, _st_load, ".safetensors"),
    Method("DCP", _dcp_save, _dcp_load),
    Method("raw numpy", _raw_save, _raw_load, ".bin"),
]


# ---------------------------------------------------------------------------------------------- rounds
def run_round(
    root: Path,
    rnd: int,
    state: State,
    target: State,
    cold: bool,
    results: dict[str, list[float]],
    check: bool,
) -> None:
    """One round of every measurement; appends seconds to ``results[key]``."""
    import torch.distributed.checkpoint as dcp

    import arraycheckpoint as acp

    for m in METHODS:
        path = str(root / f"{m.name.replace(' ', '_')}-{rnd}{m.suffix}")
        with stopwatch() as t:
            m.save(path, state)
            sync()
        results[f"{m.name}/save"].append(t[0])
        results[f"{m.name}/save_cpu"].append(t[1])
        results[f"{m.name}/bytes"].append(tree_bytes(path))
        with stopwatch() as t:
            loaded = m.load(path, state, target)
        results[f"{m.name}/load"].append(t[0])
        results[f"{m.name}/load_cpu"].append(t[1])
        if check and not same(state, loaded):
            raise SystemExit(f"{m.name}: loaded state differs from the saved one")
        del loaded
        if cold:
            drop_page_cache()
            with stopwatch() as t:
                loaded = m.load(path, state, target)
            results[f"{m.name}/load_cold"].append(t[0])
            del loaded
        remove(path)

    # async: blocking time, and the time until the checkpoint is durable
    path = str(root / f"acp_async-{rnd}")
    with stopwatch() as t:
        fut = acp.save_async(path, {"model": state})
        fut.staged.result()
    results["arraycheckpoint/async_block"].append(t[0])
    results["arraycheckpoint/async_block_cpu"].append(t[1])
    with stopwatch(pause=False) as t2:
        fut.result()
        sync()
    results["arraycheckpoint/async_total"].append(t[0] + t2[0])
    remove(path)

    path = str(root / f"dcp_async-{rnd}")
    with stopwatch() as t:
        dfut = dcp.async_save(state, checkpoint_id=path)
    results["DCP/async_block"].append(t[0])
    results["DCP/async_block_cpu"].append(t[1])
    with stopwatch(pause=False) as t2:
        dfut.result()
        sync()
    results["DCP/async_total"].append(t[0] + t2[0])
    remove(path)

    buffers = target
    with stopwatch() as t:
        for k, v in state.items():
            buffers[k].copy_(v)
    results["memcpy/async_block"].append(t[0])
    results["memcpy/async_block_cpu"].append(t[1])


# ---------------------------------------------------------------------------------------------- report
def report(
    results: dict[str, list[float]],
    total: int,
    cold: bool,
    repeats: int,
    stat: Callable[[list[float]], float] = median,
    label: str = "median",
) -> str:
    """The tables (wall seconds and ratios, CPU seconds, async blocking) and the target lines."""
    med = {k: stat(v) for k, v in results.items()}
    nan = float("nan")
    kinds = ("save", "load", "load_cold", "save_cpu", "load_cpu")
    ours = {k: med.get(f"arraycheckpoint/{k}", nan) for k in kinds}
    gb = total / 1e9
    headers = ["method", "save s", "save GB/s", "acp speed-up", "load s (warm)", "acp speed-up"]
    if cold:
        headers += ["load s (cold)", "acp speed-up"]
    headers += ["save CPU s", "load CPU s"]
    rows = []
    for m in METHODS:
        s, ld = med[f"{m.name}/save"], med[f"{m.name}/load"]
        row = [m.name, fmt_seconds(s), f"{gb / s:.2f}", fmt_ratio(ratio(s, ours["save"]))]
        row += [fmt_seconds(ld), fmt_ratio(ratio(ld, ours["load"]))]
        if cold:
            lc = med[f"{m.name}/load_cold"]
            row += [fmt_seconds(lc), fmt_ratio(ratio(lc, ours["load_cold"]))]
        row += [fmt_seconds(med[f"{m.name}/save_cpu"]), fmt_seconds(med[f"{m.name}/load_cpu"])]
        rows.append(row)
    table = markdown_table(headers, rows)

    arows = []
    memcpy = med["memcpy/async_block"]
    for name in ("arraycheckpoint", "DCP", "memcpy"):
        b = med[f"{name}/async_block"]
        row = [name, fmt_seconds(b), fmt_ratio(ratio(b, memcpy)), fmt_seconds(med[f"{name}/async_block_cpu"])]
        arows.append(row + [fmt_seconds(med.get(f"{name}/async_total", nan))])
    atable = markdown_table(
        ["async save", "blocking s", "vs memcpy", "blocking CPU s", "until durable s"], arows
    )

    def speedup(anchor: str, what: str) -> float:
        return ratio(med[f"{anchor}/{what}"], ours[what])

    checks = [
        ("save >= 1.5x faster than DCP", speedup("DCP", "save"), 1.5),
        ("save >= 1.5x faster than torch.save", speedup("torch.save", "save"), 1.5),
        ("save >= 0.7x the raw write", speedup("raw numpy", "save"), 0.7),
        ("load >= 1.5x faster than DCP (warm)", speedup("DCP", "load"), 1.5),
    ]
    if cold:
        checks.append(("load >= 1.5x faster than DCP (cold)", speedup("DCP", "load_cold"), 1.5))
    lines = [f"- {what}: {fmt_ratio(x)} ({verdict(x >= goal)})" for what, x, goal in checks]
    blk = ratio(med["arraycheckpoint/async_block"], memcpy)
    lines.append(f"- async blocking <= 1.5x memcpy: {fmt_ratio(blk)} ({verdict(blk <= 1.5)})")
    sizes = ", ".join(f"{m.name} {med[f'{m.name}/bytes'] / MiB:.0f}" for m in METHODS)
    how = " and cold (page cache dropped before each load of every method)" if cold else ""
    return (
        f"State: {total / MiB:.0f} MiB ({N_LARGE} large + {N_SMALL} small tensors, float32 and bfloat16); "
        f"{label} of {repeats} rounds after a warm-up round; every save timed until os.sync() returns; "
        f"loads warm{how}.\n"
        f"Files on disk (MiB): {sizes}. Speed-up = anchor time / arraycheckpoint time (> 1: we are faster).\n\n"
        f"{table}\n\n{atable}\n\nTargets ({label}):\n" + "\n".join(lines)
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=1024, help="total state size (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under /tmp)")
    p.add_argument(
        "--cold",
        choices=("auto", "yes", "no"),
        default="auto",
        help="also time loads with the page cache dropped (needs root; default: when possible)",
    )
    args = p.parse_args(argv)

    warnings.filterwarnings("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    cold = can_drop_page_cache() if args.cold == "auto" else args.cold == "yes"
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="acp-bench-single-", dir=base))
    print(machine_description(root), flush=True)

    state = make_state(args.size_mib)
    target = empty_like(state)
    total = nbytes(state)
    print(f"state: {len(state)} tensors, {total / MiB:.0f} MiB; checkpoints under {root}", flush=True)
    results: dict[str, list[float]] = defaultdict(list)
    try:
        for rnd in range(args.repeats + 1):
            r: dict[str, list[float]] = defaultdict(list)
            run_round(root, rnd, state, target, cold, r, check=rnd == 0)
            label = "warm-up" if rnd == 0 else f"round {rnd}"
            print(
                f"{label}: "
                + ", ".join(f"{k} {v[0]:.3f}" for k, v in r.items() if not k.endswith(("bytes", "cpu"))),
                flush=True,
            )
            if rnd > 0:
                for k, v in r.items():
                    results[k].extend(v)
    finally:
        remove(root)
    for stat, label in ((median, "median"), (min, "best")):
        print()
        print(report(results, total, cold, args.repeats, stat, label))
    print(f"\npeak RSS of the benchmark process: {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
