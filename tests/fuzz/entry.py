"""Entry points of arraycheckpoint, driven on one corpus item inside an isolated worker process.

:func:`child` runs in a process forked from a forkserver that has torch, tensorstore, zarr and
arraycheckpoint imported (a case costs a fork, not an interpreter start). It caps its address space
(``RLIMIT_AS``: what it had plus :data:`MEMORY_BUDGET`), runs one entry point and sends back what happened:
success, an exception (its type, whether it is one of ours, its message) or a CLI exit code with the output.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import traceback
from typing import Any

#: What one case may allocate beyond the worker's own footprint.
MEMORY_BUDGET = 3 << 29  # 1.5 GiB

NATIVE = ("load", "store", "verify", "inspect", "diff", "export", "metrics", "rename", "manager")
HF = ("load", "import", "inspect", "verify")
DCP = ("load", "import")
MANAGER = ("manager",)
ENTRIES = {"native": NATIVE, "hf": HF, "dcp": DCP, "manager": MANAGER}
#: entry points that write: they get a private rebuild of the item
WRITERS = frozenset({"rename", "manager"})


def _target() -> dict[str, Any]:
    import torch

    return {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4)}}


def _cli(*args: str) -> dict[str, Any]:
    from arraycheckpoint.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse
            code = int(e.code or 0)
    return {"kind": "exit", "code": code, "msg": (err.getvalue() + out.getvalue())[-4000:]}


def _store(path: str) -> None:
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    group = zarr.open_group(checkpoint_store(path), mode="r")
    for name in ("model/w", "model/b"):
        group[name][...]


def run(entry: str, kind: str, path: str, work: str, good: str) -> dict[str, Any]:
    """Run ``entry`` on the item at ``path`` (``work``: a private directory for outputs; ``good``: a valid
    checkpoint to compare with). Returns the outcome (see the module docstring)."""
    import arraycheckpoint as acp

    out = os.path.join(work, "out")
    if entry == "load":
        acp.load(path, _target(), strict=False, allow_pickle=(kind == "dcp"))
    elif entry == "store":
        _store(path)
    elif entry in ("verify", "inspect", "metrics"):
        return _cli(entry, path)
    elif entry == "diff":
        return _cli("diff", path, good)
    elif entry == "export":
        return _cli("export", path, out)
    elif entry == "import":
        return _cli("import", path, out, *(["--allow-pickle"] if kind == "dcp" else []))
    elif entry == "rename":
        mapping = os.path.join(work, "map.json")
        with open(mapping, "w") as f:
            f.write('{"model/b": "model/b2"}')
        return _cli("rename", path, "--map", mapping)
    elif entry == "manager":
        from arraycheckpoint import CheckpointManager

        with CheckpointManager(path) as m:
            latest = m.latest_step()
            m.restore(state=_target(), strict=False)
        return {"kind": "ok", "latest": latest}
    else:
        raise AssertionError(entry)
    return {"kind": "ok"}


def child(conn: Any, entry: str, kind: str, path: str, work: str, good: str) -> None:
    """The worker's body: cap memory, run, report through ``conn``."""
    with open("/proc/self/status") as f:
        vm = int(f.read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_BUDGET, resource.RLIM_INFINITY))
    os.chdir(work)
    from arraycheckpoint.errors import ArrayCheckpointError

    try:
        result = run(entry, kind, path, work, good)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {
            "kind": "error",
            "type": type(e).__name__,
            "ours": isinstance(e, ArrayCheckpointError),
            "msg": str(e)[:4000],
            "trace": traceback.format_exc()[-3000:],
        }
    conn.send(result)
    conn.close()
