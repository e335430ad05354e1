"""A damaged or hostile dataloader index is an InconsistentCheckpointError naming the namespace, never a bare
KeyError / ValueError / TypeError from deep in the load (session 20 review)."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_dataloader_stacked import PositionLoader, _save

import arraycheckpoint as acp


def _set(*path: str, value: Any) -> Callable[[dict], None]:
    def mutate(objects: dict) -> None:
        node = objects
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return mutate


def _pop(*path: str) -> Callable[[dict], None]:
    def mutate(objects: dict) -> None:
        node = objects
        for p in path[:-1]:
            node = node[p]
        node.pop(path[-1])

    return mutate


def _rename_worker(objects: dict) -> None:
    workers = objects["dataloader/~shards"]["template"]["workers"]
    workers["a"] = workers.pop("0")


CASES = {
    "no replicated part": _pop("dataloader", "value", "replicated"),
    "dp_size not a number": _set("dataloader", "value", "dp_size", value="x"),
    "dp_size negative": _set("dataloader", "value", "dp_size", value=-3),
    "dp_size zero": _set("dataloader", "value", "dp_size", value=0),
    "num_workers a bool": _set("dataloader", "value", "num_workers", value=True),
    "value a list": _set("dataloader", "value", value=[1]),
    "worker not a number": _rename_worker,
    "shard without meta": _pop("dataloader/~shards", "template", "workers", "0", "meta"),
    "shard meta a list": _set("dataloader/~shards", "template", "workers", "0", "meta", value=[1]),
    "dp_rank not a number": _set("dataloader/~shards", "template", "dp_rank", value="zz"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dl") / "ck"
    _save(0, 1, str(root), False)
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_index_names_the_dataloader(saved: Path, tmp_path: Path, case: str) -> None:
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    objects = copy.deepcopy(doc["objects"])
    CASES[case](objects)
    doc["objects"] = objects
    meta.write_text(json.dumps(doc))
    with pytest.raises(acp.InconsistentCheckpointError, match="dataloader 'dataloader'.*damaged"):
        acp.load(str(path), {"dataloader": PositionLoader(0, 1)})


def test_the_untouched_index_still_loads(saved: Path) -> None:
    loader = PositionLoader(0, 1)
    acp.load(str(saved), {"dataloader": loader})
    assert sorted(loader.loaded) == [(0, 0), (0, 1)]
