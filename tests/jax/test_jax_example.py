"""The torch -> JAX example runs and reports bit-exact parameters."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_to_jax_example(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "torch_to_jax.py"), str(tmp_path / "ck")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "bit-exact" in line]
    assert len(lines) == 4 and all(line.endswith("True") for line in lines), proc.stdout
    assert "== torch weight.T: True" in proc.stdout
