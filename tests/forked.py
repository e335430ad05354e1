"""Run a function in a fresh process that starts with its imports done: a fork of one preloaded server.

A test that must run code in its own process (a case that used to abort the interpreter, the command line
run as a user runs it) paid a new interpreter and its imports each time: about 0.5 s of CPU for the command
line, 2 s for anything that imports torch, and the suite does it hundreds of times. ``run_forked`` forks the
process from a forkserver that imported :data:`PRELOAD` once per test session: a crash, ``os._exit``, a hang,
a leaked thread or a changed ``os.environ`` stays in that process, as with ``subprocess.run``. It is not a new
interpreter: what the preloaded modules did at import is done, so a test of import-time behaviour (what a
command imports, a fresh process's first load) keeps a real ``subprocess.run``.

Usage (``fn`` at module level: it travels by reference)::

    proc = run_forked(fn, arg1, arg2, env={"AWS_REGION": "x"}, timeout=300)
    proc.returncode, proc.stdout, proc.stderr      # a subprocess.CompletedProcess

The child gets the caller's ``os.environ`` (and ``env`` on top), working directory and ``sys.argv[0]``-less
argv; its file descriptors 1 and 2 go to files read back as ``stdout``/``stderr``. The exit code is what a
``python`` running ``fn`` as its main program would return: 0, ``SystemExit``'s code, 1 after an uncaught
exception (its traceback on stderr), or ``-signal`` when the process was killed.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

#: Imported once by the forkserver (the fuzz suite's cases use the same server and list: one server per
#: process, whichever starts it first, so both name every module either needs).
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed.checkpoint",
    "tensorstore",
    "zarr",
    "safetensors.torch",
    "arraycheckpoint",
    "arraycheckpoint.api",
    "arraycheckpoint.engine.load",
    "arraycheckpoint.adapters.torch",
    "arraycheckpoint.zarr",
    "arraycheckpoint.cli",
    *(f"arraycheckpoint.tools.{m}" for m in ("verify", "export", "importer", "diff", "metrics", "rename")),
    "arraycheckpoint.sources.safetensors",
    "arraycheckpoint.sources.dcp",
    "arraycheckpoint.manager",
    "fuzz.entry",
]


def context() -> Any:
    """The forkserver context, its preload set (a no-op once the server runs)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(fn: Callable[..., Any], args: tuple, env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, name in ((1, out), (2, err)):
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.argv = [""]
    try:
        fn(*args)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - as the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (a process of the forkserver would not)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_forked(
    fn: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``fn(*args)`` in a forked process of the preloaded server; its exit code and output."""
    ctx = context()
    full = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="acp-forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = ctx.Process(target=_child, args=(fn, args, full, cwd or os.getcwd(), out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([fn.__name__, *map(str, args)], timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(
            [fn.__name__, *map(str, args)], proc.exitcode, _read(out), _read(err)
        )


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
