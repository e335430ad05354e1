"""Many small tensors, single process: arraycheckpoint against DCP, safetensors and torch.save.

The state is ``--count`` float32 tensors of ``--kib`` KiB each (2,000 x 16 KiB by default; the issue's second
case is ``--kib 256``). Every round runs every method once, one after the other (interleaved, the order rotated
each round), so a burst of load on a shared machine lands on all of them; the per-round ratio anchor / ours is
paired, and the report gives the median of those ratios over the timed rounds (the first round is a warm-up).
The protocol is ``benchmarks/common.py``'s: saves are timed until ``os.sync()`` returns, loads until the
preallocated target tensors hold the data (``torch.load`` and safetensors return new tensors, which are copied
into the targets, as ``load_state_dict`` does). CPU seconds (user + system of this process, all threads) sit
next to wall seconds: the CPU figure moves much less with the machine's load. Two reference rows show what the
file system costs: ``acp, no packs`` is arraycheckpoint with ``PlanOptions(pack_array_bytes=0)`` (every tensor
in its own directory, format 4's layout) and ``format floor`` the bare file operations of that layout without
any encoding; ``files`` counts the files each method left. Run::

    python benchmarks/bench_small.py                          # 2,000 x 16 KiB, 3 timed rounds
    python benchmarks/bench_small.py --kib 256 --json out.json
    python benchmarks/bench_small.py --tensors 100000        # 100,000 tensors of 4 floats: acp and DCP only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_single import METHODS as _ALL_METHODS  # noqa: E402
from bench_single import Method, State, same  # noqa: E402
from common import (  # noqa: E402
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
)

#: what one tensor's Zarr array costs the file system, without encoding: a directory, a ``zarr.json`` of the
#: size ours has, and the chunk's bytes in one file, written by as many threads as arraycheckpoint uses for
#: small files (one per 4 cores, at most 4); loads read each chunk file into its target
_FLOOR_DOC = b"{" + b" " * 598 + b"}"


def _floor_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _floor_save(path: str, state: State) -> None:
    from concurrent.futures import ThreadPoolExecutor

    os.mkdir(path)
    items = list(state.items())

    def write(part: list[tuple[str, torch.Tensor]]) -> None:
        for k, t in part:
            d = os.path.join(path, k)
            os.mkdir(d)
            for name, data in (("zarr.json", _FLOOR_DOC), ("c.0.0", memoryview(t.numpy()).cast("B"))):
                fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)

    n = _floor_threads()
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(write, [items[i::n] for i in range(n)]))


def _floor_load(path: str, state: State, target: State) -> State:
    for k, t in target.items():
        with open(os.path.join(path, k, "c.0.0"), "rb") as f:
            f.readinto(memoryview(t.numpy()).cast("B"))
    return target


def _unpacked_save(path: str, state: State) -> None:
    import arraycheckpoint as acp

    acp.save(path, {"model": state}, plan_options=acp.PlanOptions(pack_array_bytes=0))


def _unpacked_load(path: str, state: State, target: State) -> State:
    import arraycheckpoint as acp

    acp.load(path, {"model": target})
    return target


FLOOR = Method("format floor", _floor_save, _floor_load)
#: arraycheckpoint with every array in its own directory (format 4's layout; ``pack_array_bytes=0``)
UNPACKED = Method("acp, no packs", _unpacked_save, _unpacked_load)
METHODS = [m for m in _ALL_METHODS if m.name in ("arraycheckpoint", "DCP", "safetensors", "torch.save")] + [
    UNPACKED,
    FLOOR,
]
OURS = "arraycheckpoint"


def make_state(count: int, kib: float, seed: int = 0) -> State:
    """``count`` float32 tensors of ``kib`` KiB each, 2-D where the size allows (rows of 256 floats)."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, int(kib * 1024) // 4)
    shape = (n // 256, 256) if n % 256 == 0 else (n,)
    return {f"layers.{i // 8}.p{i % 8}": torch.randn(shape, generator=g) for i in range(count)}


#: the methods of ``--tensors`` (tensors of a few floats): the others' rows would take most of the run
TINY_METHODS = [m for m in METHODS if m.name in (OURS, "DCP")]
#: floats per tensor of ``--tensors``
TINY_FLOATS = 4


def run_round(
    root: Path, rnd: int, state: State, target: State, check: bool, methods: list[Method] = METHODS
) -> dict[str, float]:
    """Every method once, in an order rotated by ``rnd``; returns ``{"<method>/<what>": seconds}``."""
    out: dict[str, float] = {}
    k = rnd % len(methods)
    for m in methods[k:] + methods[:k]:
        path = str(root / f"{m.name.replace(' ', '_').replace('.', '_')}-{rnd}{m.suffix}")
        with stopwatch() as t:
            m.save(path, state)
            sync()
        out[f"{m.name}/save"], out[f"{m.name}/save_cpu"] = t
        out[f"{m.name}/files"] = _files(path)
        with stopwatch() as t:
            loaded = m.load(path, state, target)
        out[f"{m.name}/load"], out[f"{m.name}/load_cpu"] = t
        if check and not same(state, loaded):
            raise SystemExit(f"{m.name}: loaded state differs from the saved one")
        for v in target.values():
            v.fill_(-1)
        del loaded
        remove(path)
    return out


def _files(path: str) -> int:
    """Files (not directories) a method left at ``path``."""
    if os.path.isfile(path):
        return 1
    return sum(len(files) for _d, _s, files in os.walk(path))


def summarise(rounds: list[dict[str, float]], methods: list[Method] = METHODS) -> dict[str, dict[str, float]]:
    """Per method and measurement: median seconds, and the paired median ratio anchor / ours."""
    summary: dict[str, dict[str, float]] = {}
    for m in methods:
        s: dict[str, float] = {}
        for what in ("save", "load", "save_cpu", "load_cpu"):
            s[what] = median([r[f"{m.name}/{what}"] for r in rounds])
            s[f"{what}_speedup"] = median([ratio(r[f"{m.name}/{what}"], r[f"{OURS}/{what}"]) for r in rounds])
        s["files"] = median([r[f"{m.name}/files"] for r in rounds])
        summary[m.name] = s
    return summary


def report(
    summary: dict[str, dict[str, float]],
    count: int,
    kib: float,
    repeats: int,
    methods: list[Method] = METHODS,
    goal: float = 1.5,
) -> str:
    """The table and a line per target (``goal``: the speed-up over DCP to reach, save and load alike)."""
    headers = [
        "method",
        "save s",
        "save CPU s",
        "acp speed-up",
        "load s",
        "load CPU s",
        "acp speed-up",
        "files",
    ]
    rows = []
    for m in methods:
        s = summary[m.name]
        rows.append(
            [
                m.name,
                fmt_seconds(s["save"]),
                fmt_seconds(s["save_cpu"]),
                fmt_ratio(s["save_speedup"]),
                fmt_seconds(s["load"]),
                fmt_seconds(s["load_cpu"]),
                fmt_ratio(s["load_speedup"]),
                f"{int(s['files']):,}" if s["files"] == s["files"] else "-",
            ]
        )
    dcp = summary["DCP"]
    each = f"{kib:g} KiB" if kib >= 1 else f"{kib * 1024:g} bytes"
    total = f"{count * kib / 1024:.1f} MiB" if count * kib >= 1024 else f"{count * kib:.1f} KiB"
    lines = [
        f"- {what}: DCP / arraycheckpoint = {fmt_ratio(dcp[f'{what}_speedup'])}, target >= {goal:g}x "
        f"({'met' if dcp[f'{what}_speedup'] >= goal else 'MISSED'})"
        for what in ("save", "load")
    ]
    return (
        f"State: {count:,} float32 tensors x {each} ({total}); median of {repeats} "
        "interleaved rounds after a warm-up round; saves timed until os.sync() returns. Speed-up = paired "
        "median of anchor time / arraycheckpoint time per round (> 1: we are faster).\n\n"
        + markdown_table(headers, rows)
        + "\n\nTargets (paired medians):\n"
        + "\n".join(lines)
    )


def git_revision() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=2000, help="number of tensors (default 2000)")
    p.add_argument("--kib", type=float, default=16, help="KiB per tensor (default 16)")
    p.add_argument(
        "--tensors",
        type=int,
        default=None,
        help=f"instead: this many tensors of {TINY_FLOATS} floats (e.g. 100000), arraycheckpoint and DCP only",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under /tmp)")
    p.add_argument("--json", default=None, help="also write the rounds and the summary to this JSON file")
    args = p.parse_args(argv)

    warnings.filterwarnings("ignore")
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="acp-bench-small-", dir=base))
    machine = machine_description(root)
    print(machine, flush=True)
    methods = METHODS
    if args.tensors is not None:
        args.count, args.kib, methods = args.tensors, TINY_FLOATS * 4 / 1024, TINY_METHODS
    state = make_state(args.count, args.kib)
    target = {k: torch.full_like(v, -1) for k, v in state.items()}
    rounds: list[dict[str, float]] = []
    try:
        for rnd in range(args.repeats + 1):
            r = run_round(root, rnd, state, target, check=rnd == 0, methods=methods)
            label = "warm-up" if rnd == 0 else f"round {rnd}"
            print(f"{label}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
            if rnd > 0:
                rounds.append(r)
    finally:
        remove(root)
    summary = summarise(rounds, methods)
    print()
    # the targets: 1.5x DCP for 16 KiB and larger tensors, 1x for tensors of a few floats
    goal = 1.0 if args.tensors is not None else 1.5
    print(report(summary, args.count, args.kib, args.repeats, methods, goal))
    rss = peak_rss_mib()
    print(
        f"\npeak RSS of the benchmark process: {rss:.0f} MiB (state {args.count * args.kib / 1024:.0f} MiB)"
    )
    if args.json:
        doc = {
            "benchmark": "bench_small",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "revision": git_revision(),
            "machine": machine,
            "load_average": os.getloadavg(),
            "count": args.count,
            "kib": args.kib,
            "repeats": args.repeats,
            "rounds": rounds,
            "summary": summary,
            "peak_rss_mib": rss,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
