"""Stored optimizer param groups are untrusted: a damaged list is named, and a hyper-parameter of another kind
than the optimizer's (``lr: "fast"``) is refused at load, not at the first ``step()`` (session 20 review: a bare
``KeyError: 0``; ``lr="fast"`` loaded and ``step()`` failed with "can't multiply sequence by non-int")."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import arraycheckpoint as acp  # noqa: E402

GROUPS = "optimizer/~param_groups"


def _train() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("opt") / "ck"
    model, opt = _train()
    acp.save(str(root), {"model": model, "optimizer": opt})
    return root


def _edited(saved: Path, tmp_path: Path, edit: Callable[[Any], Any]) -> Path:
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["objects"][GROUPS]["value"] = edit(doc["objects"][GROUPS]["value"])
    meta.write_text(json.dumps(doc))
    return path


def _target() -> tuple[Any, Any]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


@pytest.mark.parametrize(
    "edit",
    [lambda g: {"0": g[0]}, lambda g: [1, 2], lambda g: [{**g[0], "params": ["weight", 3]}]],
    ids=["an object", "numbers", "params not names"],
)
def test_damaged_param_groups_are_named(saved: Path, tmp_path: Path, edit: Callable[[Any], Any]) -> None:
    path = _edited(saved, tmp_path, edit)
    model, opt = _target()
    with pytest.raises(acp.InconsistentCheckpointError, match="optimizer/~param_groups"):
        acp.load(str(path), {"model": model, "optimizer": opt})


@pytest.mark.parametrize("key,value", [("lr", "fast"), ("betas", "x"), ("betas", [0.9]), ("amsgrad", 1)])
def test_a_hyper_parameter_of_another_kind_is_refused_strict_and_kept_otherwise(
    saved: Path, tmp_path: Path, key: str, value: Any
) -> None:
    path = _edited(saved, tmp_path, lambda g: [{**g[0], key: value}])
    model, opt = _target()
    with pytest.raises(acp.StateMismatchError, match=rf"param_groups\[0\].*{key}="):
        acp.load(str(path), {"model": model, "optimizer": opt})
    model, opt = _target()
    before = opt.param_groups[0][key]
    acp.load(str(path), {"model": model, "optimizer": opt}, strict=False)
    assert opt.param_groups[0][key] == before
    assert opt.param_groups[0]["weight_decay"] == 0.01  # the rest was restored
    model(torch.ones(1, 3)).sum().backward()
    opt.step()


def test_an_untouched_checkpoint_restores_every_hyper_parameter(saved: Path) -> None:
    model, opt = _target()
    acp.load(str(saved), {"model": model, "optimizer": opt})
    ref = _train()[1]
    assert opt.param_groups[0]["lr"] == 0.1
    for (pa, a), (pb, b) in zip(opt.state.items(), ref.state.items(), strict=True):
        assert pa.shape == pb.shape and all(torch.equal(a[k], b[k]) for k in b)
