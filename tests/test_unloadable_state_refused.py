"""A save never commits a checkpoint whose metadata every load refuses, and a self-containing or ~1,000-deep
state is a clear error before anything is written (session 20 review: extra state nested 95-1,000 levels saved,
then every load said the metadata "nests JSON 104 levels deep ... (extra state this deep cannot be saved
either)"; deeper, or a dict holding itself, was a bare RecursionError)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arraycheckpoint as acp


def _nest(n: int, leaf: Any = 1) -> Any:
    for _ in range(n):
        leaf = [leaf]
    return leaf


FORMS = {
    "plain": lambda n: {"x": _nest(n)},
    "dicts": lambda n: {"x": _nest(n, {"k": 1})},
    "per_rank": lambda n: {"x": acp.PerRank(_nest(n))},
    "per_rank_with_array": lambda n: {"x": acp.PerRank({"a": _nest(n), "b": np.arange(3)})},
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_deepest_state_a_save_accepts_loads_and_one_deeper_is_refused(tmp_path: Path, form: str) -> None:
    make = FORMS[form]
    deepest = None
    for n in range(86, 100):  # the load refuses metadata nested over 100
        path = tmp_path / f"n{n}"
        try:
            acp.save(str(path), {"extra_state": make(n)})
        except acp.ArrayCheckpointError as e:
            assert "extra_state" in str(e) and "nests" in str(e)
            assert not path.exists()
            break
        deepest = n
    else:
        pytest.fail("a state nested 99 levels was saved: no load accepts its metadata")
    assert deepest is not None
    loaded = acp.load(str(tmp_path / f"n{deepest}"), {"extra_state": {}})["extra_state"]
    value = loaded["x"].value if isinstance(loaded["x"], acp.PerRank) else loaded["x"]
    expected = make(deepest)["x"]
    expected = expected.value if isinstance(expected, acp.PerRank) else expected
    if isinstance(expected, dict):
        assert np.array_equal(value["b"], expected["b"])
        value, expected = value["a"], expected["a"]
    assert json.dumps(value) == json.dumps(expected)


@pytest.mark.parametrize("how", ["cycle", "thousands"])
def test_a_state_too_deep_for_python_is_an_error_naming_the_fix(tmp_path: Path, how: str) -> None:
    if how == "cycle":
        value: Any = {}
        value["self"] = value
    else:
        value = _nest(5000)
    with pytest.raises(acp.InvalidStateError, match="nests too deep"):
        acp.save(str(tmp_path / "c"), {"extra_state": {"x": value}})
    assert not os.path.exists(tmp_path / "c")


def test_import_of_a_directory_whose_config_nests_too_deep_commits_nothing(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from arraycheckpoint.tools.importer import import_checkpoint

    src = tmp_path / "hf"
    src.mkdir()
    st.save_file({"w": torch.ones(2)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"a": _nest(97)}))
    with pytest.raises(acp.ArrayCheckpointError, match="hf_config"):
        import_checkpoint(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


class _Counter:
    """A stateful object (state_dict / load_state_dict) as schedulers are."""

    def __init__(self) -> None:
        self.n = 3

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def _extra_edits() -> dict[str, Any]:
    es, pr = "extra_state", "extra_state/~per_rank"
    return {
        "no document": lambda o: o[es]["value"].pop("doc"),
        "a per-rank slot past the end": lambda o: o[es]["value"]["doc"]["a"].__setitem__(
            "__acp_per_rank__", 7
        ),
        "array kinds a list": lambda o: o[es]["value"].__setitem__("arrays", [1]),
        "no per-rank object": lambda o: o.pop(pr),
        "a state dict that is a number": lambda o: o[es]["value"]["doc"].__setitem__("s", 5),
    }


@pytest.mark.parametrize("case", sorted(_extra_edits()))
def test_damaged_extra_state_is_named_not_a_bare_python_error(tmp_path: Path, case: str) -> None:
    """Each was a bare KeyError / IndexError / TypeError (the last from the object's own load_state_dict)."""
    import shutil

    root = tmp_path / "ck"
    acp.save(str(root), {"extra_state": {"a": acp.PerRank({"x": 1}), "s": _Counter(), "g": 5}})
    good = acp.load(str(root), {"extra_state": {"a": acp.PerRank(None), "s": _Counter(), "g": 0}})
    assert good["extra_state"]["a"].value == {"x": 1} and good["extra_state"]["g"] == 5
    path = tmp_path / "bad"
    shutil.copytree(root, path)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    _extra_edits()[case](doc["objects"])
    meta.write_text(json.dumps(doc))
    with pytest.raises(acp.InconsistentCheckpointError, match="^extra_state: "):
        acp.load(str(path), {"extra_state": {"a": acp.PerRank(None), "s": _Counter(), "g": 0}})


@pytest.mark.parametrize("part", ["numpy", "torch"])
def test_rng_restore_of_a_damaged_state_changes_no_generator(part: str) -> None:
    """A loaded RNG state is untrusted: python's generator was set before numpy's (or torch's) failed, leaving
    the process half-restored, with a bare IndexError / RuntimeError."""
    import copy
    import random

    torch = pytest.importorskip("torch")
    from arraycheckpoint import rng

    good = rng.capture()
    bad = copy.deepcopy(good)
    if part == "numpy":
        bad["numpy"]["key"] = bad["numpy"]["key"][:5]
    else:
        bad["torch"] = bad["torch"][:10]
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with pytest.raises(ValueError, match="no generator was changed"):
        rng.restore(bad)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    rng.restore(good)
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.restore(good)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
