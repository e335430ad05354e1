"""Run JAX test bodies in other interpreters, with a forced number of CPU devices.

JAX fixes its device count when it is first imported (``XLA_FLAGS=--xla_force_host_platform_device_count``),
so every JAX body runs in another interpreter: pytest's process may already hold jax with one device, and
other test files are unaffected. One process (``processes=1``) runs in a JAX interpreter that is **kept**
between calls (keyed by the device count and the environment, like the gloo pools of ``dist.py``): starting
one costs about a second of CPU (jax, XLA's devices, arraycheckpoint's imports) and the suite calls this a few
dozen times; a body that raised, a timeout or a dead interpreter retires it. ``processes > 1`` starts a
multi-controller JAX job in fresh interpreters (``jax.distributed.initialize`` against a coordinator on
loopback), ``devices // processes`` devices each. ``ACP_TEST_POOL=0`` starts a fresh interpreter every call.

Usage in a test module (module-level body, JSON-able arguments and return value)::

    def body(tmp):
        import jax
        ...
        return {"ok": True}

    def test_x(tmp_path):
        (result,) = run_jax(__file__, "body", str(tmp_path))

This directory must not get an ``__init__.py``: ``tests/`` is on ``sys.path`` and a package named ``jax``
there would shadow the real one.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist import env_key, free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


def run_jax(
    module_file: str, fn: str, *args: Any, devices: int = 8, processes: int = 1, timeout: float = 300
) -> list[Any]:
    """Run ``fn(*args)`` from ``module_file`` in ``processes`` JAX processes; results in process order."""
    if processes == 1 and os.environ.get("ACP_TEST_POOL", "1") != "0":
        return [_server_for(devices).run(os.path.abspath(module_file), fn, list(args), timeout)]
    return _run_fresh(module_file, fn, *args, devices=devices, processes=processes, timeout=timeout)


def _jax_env(devices: int, processes: int) -> dict[str, str]:
    return dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // processes}",
        JAX_PLATFORMS="cpu",
        ACP_JAX_PROCESSES=str(processes),
    )


class _Server:
    """One JAX interpreter (``_worker.py --serve``) that runs bodies one at a time: a job is a JSON line on its
    stdin, its answer a line on a pipe of its own (the body's output goes to the log)."""

    def __init__(self, env: dict[str, str]) -> None:
        ack_r, ack_w = os.pipe()
        self.log = tempfile.TemporaryFile("w+b")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "--serve", str(ack_w)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(ack_w,),
        )
        os.close(ack_w)
        self.ack = ack_r

    def run(self, module_file: str, fn: str, args: list[Any], timeout: float) -> Any:
        start = os.fstat(self.log.fileno()).st_size
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            answer = ""
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps([module_file, fn, args, out]) + "\n").encode())
                self.proc.stdin.flush()
                if select.select([self.ack], [], [], timeout)[0]:
                    answer = os.read(self.ack, 64).decode().strip()
            except (BrokenPipeError, OSError):
                answer = ""
            if answer == "ok":
                with open(out) as f:
                    return json.load(f)
        text = os.pread(self.log.fileno(), 1 << 20, start).decode(errors="replace")
        _retire(self)
        why = {"": f"no answer within {timeout} s or the process died", "error": "the body raised"}.get(
            answer
        )
        raise AssertionError(f"jax subprocess failed:\n--- jax process 0 ({why}) ---\n{text[-6000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        os.close(self.ack)
        self.log.close()


SERVERS_KEPT = 2  # one per device count in practice
_servers: dict[tuple[int, frozenset[tuple[str, str]]], _Server] = {}


def _server_for(devices: int) -> _Server:
    env = _jax_env(devices, 1)
    key = (devices, env_key(env))
    server = _servers.pop(key, None)
    if server is not None and not server.alive():
        server.close()
        server = None
    if server is None:
        while len(_servers) >= SERVERS_KEPT:
            _servers.pop(next(iter(_servers))).close()  # the least recently used
        server = _Server(env)
    _servers[key] = server  # most recently used last
    return server


def _retire(server: _Server) -> None:
    for key, s in list(_servers.items()):
        if s is server:
            del _servers[key]
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
    server.close()


@atexit.register
def _close_all() -> None:
    while _servers:
        _servers.popitem()[1].close()


def _run_fresh(
    module_file: str, fn: str, *args: Any, devices: int, processes: int, timeout: float
) -> list[Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for pid in range(processes):
            env = _jax_env(devices, processes)
            env.update(ACP_JAX_COORDINATOR=f"127.0.0.1:{port}", ACP_JAX_PROCESS_ID=str(pid))
            out = os.path.join(tmp, f"result{pid}.json")
            cmd = [sys.executable, WORKER, os.path.abspath(module_file), fn, json.dumps(list(args)), out]
            log = open(os.path.join(tmp, f"log{pid}.txt"), "w+")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, out))
        failures = []
        results = []
        for pid, (p, log, out) in enumerate(procs):
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q, _, _ in procs:
                    q.kill()
                rc = "timeout"
            log.seek(0)
            text = log.read()
            log.close()
            if rc != 0:
                failures.append(f"--- jax process {pid} (exit {rc}) ---\n{text[-6000:]}")
            else:
                with open(out) as f:
                    results.append(json.load(f))
        if failures:
            raise AssertionError("jax subprocess failed:\n" + "\n".join(failures))
        return results
