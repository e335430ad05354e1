"""Arguments and targets that used to be ignored without a word: empty namespaces under strict, torch
``transforms``, ``key_map`` entries that match nothing, flax ``nnx.State`` targets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import StateMismatchError


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Linear(4, 3)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


@pytest.mark.parametrize("saved_as", [None, "optim"])
def test_strict_load_of_a_namespace_with_nothing_stored_raises(tmp_path: Path, saved_as: str | None) -> None:
    m, opt = _trained()
    state = {"model": m} if saved_as is None else {"model": m, saved_as: opt}
    acp.save(tmp_path / "c", state)
    m2, opt2 = _fresh()
    with pytest.raises(StateMismatchError, match="nothing for namespace\\(s\\) 'optimizer'") as info:
        acp.load(tmp_path / "c", {"model": m2, "optimizer": opt2})
    stored = "'model'" if saved_as is None else "'model', 'optim'"
    assert f"it stores {stored}" in str(info.value)
    # strict=False loads the rest; the optimizer keeps its own lr
    acp.load(tmp_path / "c", {"model": m2, "optimizer": opt2}, strict=False)
    assert torch.equal(m2.weight, m.weight) and opt2.param_groups[0]["lr"] == 0.1


def test_transforms_for_torch_targets_are_refused(tmp_path: Path) -> None:
    m, _ = _trained()
    acp.save(tmp_path / "c", {"model": m})
    with pytest.raises(acp.InvalidArgumentError, match="transforms= applies to jax targets only"):
        acp.load(tmp_path / "c", {"model": _fresh()[0]}, transforms={"model/weight": lambda x: x.T})


def test_key_map_entry_matching_no_target(tmp_path: Path) -> None:
    m, _ = _trained()
    acp.save(tmp_path / "c", {"model": m})
    m2, _ = _fresh()
    typo = {"model/wieght": "model/weight", "model/bias": "model/bias"}
    with pytest.raises(
        StateMismatchError, match="key_map entries that match no target name \\(1\\): model/wieght"
    ):
        acp.load(tmp_path / "c", {"model": m2}, key_map=typo)
    report: dict = {}
    acp.load(tmp_path / "c", {"model": m2}, key_map=typo, strict=False, report=report)
    assert report["unmatched_key_map"] == ["model/wieght"]
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)
