"""Helpers of the fault-injection suite: build a small checkpoint, tamper with it, run a load in isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


#: The directory layout (format 4's): every array in its own directory, which the cases here damage. Packed
#: arrays (format 5) have their own hostile cases (tests/faults/test_hostile_packs.py).
UNPACKED = {"pack_array_bytes": 0}


def save_small(path: str, *, compression: str | None = None, extra: Any = None) -> dict[str, Any]:
    """Save a tiny model (and optional extra state) to ``path`` in the directory layout; return the state
    saved."""
    import numpy as np
    import torch

    import arraycheckpoint as acp

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    state: dict[str, Any] = {"model": model}
    if extra is not None:
        state["extra_state"] = extra
    acp.save(path, state, compression=compression, plan_options=acp.PlanOptions(**UNPACKED))
    return {"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone(), "np": np}


def edit_metadata(root: str, fn: Any) -> None:
    """Rewrite the metadata of ``root`` through ``fn(doc)`` (in place, as an attacker would)."""
    from arraycheckpoint.format.metadata import METADATA_FILE

    p = Path(root) / METADATA_FILE
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def edit_zarr_json(array_dir: str, fn: Any) -> None:
    p = Path(array_dir) / "zarr.json"
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def chunk_files(array_dir: str) -> list[str]:
    from arraycheckpoint.testing import chunk_files as files

    return [str(p) for p in files(array_dir)]


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a case that used to abort or hang cannot take pytest with it)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )


LOAD_AND_REPORT = """
import sys, torch, arraycheckpoint as acp
model = torch.nn.Linear(64, 32)
state = {{"model": model}}
{extra}
try:
    acp.load({path!r}, state)
except Exception as e:
    print("RAISED", type(e).__name__, str(e)[:2000])
    sys.exit(0)
print("LOADED")
"""


def load_in_subprocess(path: str, extra: str = "", timeout: float = 120) -> str:
    """Load ``path`` into a fresh Linear(64, 32) in a subprocess; returns ``"RAISED <type> <msg>"`` or fails
    the test if the process died (a signal, ``std::bad_alloc``) or loaded."""
    proc = run_isolated(LOAD_AND_REPORT.format(path=path, extra=extra), timeout=timeout)
    assert proc.returncode == 0, f"the loading process died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]
