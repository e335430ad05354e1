"""Error classes of issue 12 live in the one hierarchy (errors.py) and are exported; ``timeout=`` of the
public verbs is validated before anything else happens."""

from __future__ import annotations

import math

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint import errors
from arraycheckpoint.checks import bounds
from arraycheckpoint.runtime import liveness


def test_fault_errors_are_exported_from_the_package_and_errors_module() -> None:
    assert acp.StalledRankError is errors.StalledRankError
    assert acp.InconsistentCheckpointError is errors.InconsistentCheckpointError
    assert {"StalledRankError", "InconsistentCheckpointError"} <= set(acp.__all__)
    # both are ArrayCheckpointErrors and keep the builtin they resemble
    assert issubclass(acp.StalledRankError, acp.ArrayCheckpointError)
    assert issubclass(acp.StalledRankError, TimeoutError)
    assert issubclass(acp.InconsistentCheckpointError, acp.MetadataError)
    assert issubclass(acp.InconsistentCheckpointError, acp.CorruptCheckpointError)
    # the old import locations are aliases of the same classes (``except`` clauses keep matching)
    assert liveness.StalledRankError is acp.StalledRankError
    assert bounds.InconsistentCheckpointError is acp.InconsistentCheckpointError


@pytest.mark.parametrize("bad", [0, -1, -0.5, math.nan, math.inf, "3", True, [3]])
def test_timeout_must_be_a_positive_finite_number(tmp_path, bad) -> None:
    model = torch.nn.Linear(4, 2)
    for call in (
        lambda: acp.save(tmp_path / "a", {"model": model}, timeout=bad),
        lambda: acp.save_async(tmp_path / "b", {"model": model}, timeout=bad),
        lambda: acp.load(tmp_path / "a", {"model": model}, timeout=bad),
        lambda: acp.CheckpointManager(tmp_path / "m").save(1, {"model": model}, timeout=bad),
    ):
        with pytest.raises(acp.InvalidArgumentError, match="timeout must be a positive finite number"):
            call()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_valid_timeout_saves_and_loads_bit_exactly(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    acp.save(tmp_path / "c", {"model": model}, timeout=2.5)
    back = torch.nn.Linear(8, 4)
    acp.load(tmp_path / "c", {"model": back}, timeout=7)
    assert torch.equal(back.weight, model.weight) and torch.equal(back.bias, model.bias)
    manager = acp.CheckpointManager(tmp_path / "m")
    manager.save(3, {"model": model}, timeout=5).result()
    again = torch.nn.Linear(8, 4)
    manager.restore(state={"model": again}, timeout=5)
    assert torch.equal(again.weight, model.weight)
