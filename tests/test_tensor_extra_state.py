"""A module whose ``get_extra_state()`` is a tensor (Transformer Engine serialises its FP8 metadata into a
``uint8`` tensor) gets its saved state back through ``set_extra_state`` (session 20 review: the load filled the
fresh tensor ``state_dict()`` had just built, never called ``set_extra_state``, and the state was lost without
a word)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import arraycheckpoint as acp  # noqa: E402


class _Fp8Like(torch.nn.Module):
    def __init__(self, scale: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.scale = scale
        self.restored: Any = None

    def get_extra_state(self) -> torch.Tensor:
        return torch.arange(4, dtype=torch.uint8) + self.scale  # built afresh on every call, as TE does

    def set_extra_state(self, state: Any) -> None:
        self.restored = state
        self.scale = int(state[0])


class _Net(torch.nn.Module):
    def __init__(self, scale: int = 0) -> None:
        super().__init__()
        self.block = _Fp8Like(scale)
        self.head = torch.nn.Linear(2, 1)


def test_tensor_extra_state_is_handed_to_set_extra_state(tmp_path: Path) -> None:
    acp.save(str(tmp_path / "c"), {"model": _Net(scale=7)})
    target = _Net()
    acp.load(str(tmp_path / "c"), {"model": target})
    assert target.block.restored is not None
    assert torch.equal(target.block.restored, torch.arange(4, dtype=torch.uint8) + 7)
    assert target.block.scale == 7


def test_a_checkpoint_holding_it_as_a_plain_tensor_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before the fix stored the extra state as an ordinary tensor entry."""
    src = _Net(scale=9)
    plain = {k: v.detach().clone() for k, v in src.state_dict().items()}
    assert "block._extra_state" in plain
    acp.save(str(tmp_path / "c"), {"model": plain})
    target = _Net()
    acp.load(str(tmp_path / "c"), {"model": target})
    assert target.block.scale == 9
    assert torch.equal(target.head.weight, src.head.weight)
