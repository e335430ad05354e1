"""A DCP save through ``acp.dcp.Writer`` that fails after its plan gives its claim of the target back.

Before (review23c D1): the coordinator's claim (taken in ``prepare_global_plan``) was given back only by
``finish``, or by ``reset`` with a checkpoint_id. A save failing between the two (a rank's ``finish_plan`` or a
collective raised; DCP then calls no ``finish``) kept it: on local disk the lock's ``flock`` stayed held in this
process, and every later save to that path failed ("another save ... is in progress in this process"), with a
fresh Writer or the same one; on object stores the lease kept refusing them. Now the Writer's next save gives
its leftover claim back first, and a Writer dropped with one gives it back when it is collected.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402


class FailsAfterPlan(DefaultSavePlanner):
    """A rank failing after the global plan (its error, or a collective's, reaches DCP there)."""

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        raise RuntimeError("rank failed after planning")


def _fails(writer: acp.dcp.Writer) -> None:
    with pytest.raises(BaseException, match="rank failed after planning"):  # DCP's CheckpointException
        dcp.save({"w": torch.arange(8.0)}, storage_writer=writer, planner=FailsAfterPlan())


def _saves(writer: acp.dcp.Writer, url: str, value: float) -> None:
    dcp.save({"w": torch.full((8,), value)}, storage_writer=writer)
    back = {"w": torch.zeros(8)}
    acp.load(url, back)
    assert torch.equal(back["w"], torch.full((8,), value))


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else f"memory://claim-{tmp_path.name}/ckpt"


def test_a_fresh_writer_saves_after_a_dropped_writers_failed_save(url: str) -> None:
    _fails(acp.dcp.Writer(url))
    gc.collect()  # the failed save's Writer is garbage (DCP's exception held it in a cycle)
    _saves(acp.dcp.Writer(url), url, 2.0)  # before: "another save ... is in progress"


def test_the_same_writer_saves_again_after_its_failed_save(url: str) -> None:
    writer = acp.dcp.Writer(url)  # its path given once: DCP calls no reset
    _fails(writer)
    _saves(writer, url, 3.0)  # before: refused by its own leftover claim
    _saves(writer, url, 4.0)
