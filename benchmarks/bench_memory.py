"""Peak host memory above the state: blocking save, load and ``save_async``, each in a fresh process.

Each measurement runs in its own child process: it builds the state (``--tensors`` float32 tensors of
``--mib`` MiB; 8 x 256 MiB = 2 GiB by default), saves it once if it measures a load, then resets the kernel's
peak-RSS counter (``/proc/self/clear_refs``) and reads ``VmHWM`` after the operation. The figure reported is
that peak minus the resident memory just before the operation, i.e. what the operation itself added. Page cache
is not resident memory of the process, so the figure is the library's buffers, not the file data in the kernel.
The expected bounds (issue 15): a blocking save or a load within ``max_inflight_bytes`` above the state (plus
one stored chunk file when a chunk is larger than the cap), ``save_async`` within one staging copy of the state
plus the cap. Run::

    python benchmarks/bench_memory.py                        # 2 GiB, default cap and a 64 MiB cap
    python benchmarks/bench_memory.py --tensors 4 --mib 64 --caps 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20

_CHILD = r"""
import json, os, sys
import torch
import arraycheckpoint as acp
from arraycheckpoint.engine import engine

op, path, tensors, mib, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
n = int(mib * (1 << 20)) // 4
state = {f"w{i}": torch.randn(n // 1024, 1024) for i in range(tensors)}
kwargs = {"max_inflight_bytes": cap} if cap else {}


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


if op == "load":
    acp.save(path, {"model": state}, **kwargs)
    target = {k: torch.full_like(v, -1) for k, v in state.items()}
    acp.read_metadata(path)  # imports and caches settle before the baseline
    from arraycheckpoint.adapters.torch import adapter  # noqa: F401
reset_peak()
before = status("VmRSS")
if op == "save":
    acp.save(path, {"model": state}, **kwargs)
elif op == "save_async":
    acp.save_async(path, {"model": state}, **kwargs).result()
else:
    acp.load(path, {"model": target}, **kwargs)  # the public verb, with the same cap as the save
    assert all(torch.equal(target[k], state[k]) for k in state)
peak = status("VmHWM")
print(json.dumps({"op": op, "cap": cap, "state": tensors * n * 4, "before": before, "peak": peak}))
"""


def measure(op: str, tensors: int, mib: float, cap: int, where: str) -> dict[str, int]:
    """Run ``op`` ("save", "save_async", "load") in a fresh process; returns its JSON record."""
    path = os.path.join(where, f"ckpt-{op}-{cap}")
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, op, path, str(tensors), str(mib), str(cap)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{op} (cap {cap}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--mib", type=float, default=256, help="MiB per tensor (default 256)")
    p.add_argument("--caps", default="0,64", help="max_inflight_bytes in MiB, 0 = the default (default 0,64)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    rows = []
    with tempfile.TemporaryDirectory(prefix="acp-bench-mem-", dir=base) as where:
        for cap_mib in (float(c) for c in args.caps.split(",")):
            for op in ("save", "load", "save_async"):
                r = measure(op, args.tensors, args.mib, int(cap_mib * MiB), where)
                rows.append(r)
                print(
                    f"{op:10s} cap {'default' if not cap_mib else f'{cap_mib:g} MiB':>9s}: state "
                    f"{r['state'] / MiB:.0f} MiB, peak RSS above the state {(r['peak'] - r['before']) / MiB:+.0f} MiB",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
