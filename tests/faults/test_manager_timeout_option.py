"""A manager's ``save_options={"timeout": ...}`` also bounds its own storage requests, so it is checked when the
manager is made (an invalid one failed later, inside a listing, with an unrelated ValueError)."""

from __future__ import annotations

import pytest

from arraycheckpoint import CheckpointManager
from arraycheckpoint.errors import InvalidArgumentError


@pytest.mark.parametrize("bad", ["soon", 0, -1.0, float("nan")])
def test_an_invalid_save_timeout_is_refused_by_the_manager(tmp_path, bad) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout must be a positive finite number"):
        CheckpointManager(tmp_path / "run", save_options={"timeout": bad})


def test_a_valid_save_timeout_bounds_the_managers_storage(tmp_path) -> None:
    with CheckpointManager(tmp_path / "run", save_options={"timeout": 7}) as mgr:
        assert mgr.storage.stall_bound() == 7.0
