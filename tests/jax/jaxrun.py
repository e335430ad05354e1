"""Run JAX test bodies in fresh subprocesses with a forced number of CPU devices.

JAX fixes its device count when it is first imported (``XLA_FLAGS=--xla_force_host_platform_device_count``),
so every JAX body runs in its own interpreter: pytest's process may already hold jax with one device, and
other test files are unaffected. ``processes > 1`` starts a multi-controller JAX job
(``jax.distributed.initialize`` against a coordinator on loopback), ``devices // processes`` devices each.

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

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist import free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


def run_jax(
    module_file: str, fn: str, *args: Any, devices: int = 8, processes: int = 1, timeout: float = 300
) -> list[Any]:
    """Run ``fn(*args)`` from ``module_file`` in ``processes`` JAX processes; results in process order."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for pid in range(processes):
            env = dict(os.environ)
            env.update(
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // processes}",
                JAX_PLATFORMS="cpu",
                ACP_JAX_COORDINATOR=f"127.0.0.1:{port}",
                ACP_JAX_PROCESSES=str(processes),
                ACP_JAX_PROCESS_ID=str(pid),
            )
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
