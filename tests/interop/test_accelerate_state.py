"""accelerate users' whole training state: prepared model, optimizer, LR scheduler and dataloader.

``acp.save`` of an accelerate-prepared dataloader over a plain ``DataLoader`` (accelerate's default) raised
a bare ``AttributeError: 'DataLoader' object has no attribute 'dl_state_dict'`` from inside accelerate; it
is now refused like a plain ``DataLoader``, naming the setting that makes it resumable. With that setting
(torchdata's ``StatefulDataLoader``) the position, the scheduler and the optimizer's lr resume exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import InvalidStateError

accelerate = pytest.importorskip("accelerate")


def _loader() -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(32, 1))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def _prepared(stateful: bool) -> tuple:
    from accelerate.utils import DataLoaderConfiguration

    acc = accelerate.Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    return acc.prepare(model, opt, _loader(), sched)


def test_a_prepared_plain_dataloader_is_refused_naming_the_setting(tmp_path: Path) -> None:
    model, opt, loader, _ = _prepared(stateful=False)
    with pytest.raises(InvalidStateError, match="use_stateful_dataloader=True"):
        acp.save(tmp_path / "ck", {"model": model, "optimizer": opt, "dataloader": loader})
    assert not (tmp_path / "ck").exists()


def test_scheduler_and_stateful_dataloader_resume_exactly(tmp_path: Path) -> None:
    pytest.importorskip("torchdata")
    model, opt, loader, sched = _prepared(stateful=True)
    it = iter(loader)
    for _ in range(3):
        (x,) = next(it)
        model(x).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "dataloader": loader}
    acp.save(tmp_path / "ck", state)
    model2, opt2, loader2, sched2 = _prepared(stateful=True)
    acp.load(
        tmp_path / "ck", {"model": model2, "optimizer": opt2, "scheduler": sched2, "dataloader": loader2}
    )
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5**3
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(next(iter(loader2))[0], next(it)[0])  # the next batch after the saved position
