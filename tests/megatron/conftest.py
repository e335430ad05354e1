"""Fixtures of the megatron tests: one TP=2 checkpoint shared by the reshard and cross-framework tests."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # megatron_helpers, importable by spawned ranks too


@pytest.fixture(scope="session")
def tp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A GPT (4 layers, SwiGLU) + Adam saved at TP=2/PP=1 on 2 ranks: (path, model tensors, optimizer tensors).

    The tensors are the source's full global tensors reassembled from both ranks' ShardedTensors.
    """
    pytest.importorskip("megatron.core")
    from dist import run_distributed
    from megatron_helpers import assemble, save_tp2

    path = str(tmp_path_factory.mktemp("megatron") / "tp2")
    results = run_distributed(save_tp2, 2, (path,))
    model = assemble([r[0] for r in results])
    optim = assemble([r[1] for r in results])
    assert {s for r in results for s in r[2]} == {1.0}
    return path, model, optim
