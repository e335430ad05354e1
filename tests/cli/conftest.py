from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # cli_helpers for spawned workers too
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/dist.py


@pytest.fixture(scope="session")
def fsdp2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A checkpoint saved by 4 FSDP2 ranks (uneven shards), and the full tensors it must hold."""
    from cli_helpers import fsdp2_save_body
    from dist import run_distributed

    path = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    results = run_distributed(fsdp2_save_body, world=4, args=(path,))
    return path, results[0]
