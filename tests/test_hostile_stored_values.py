"""Stored JSON values with a malformed type tag are refused naming the entry: ``format/extras.decode``, which
every reader of stored JSON values goes through (torch and JAX extra state, optimizer param groups, stateful
objects, megatron extra state, DCP values), trusted its tags ({'__tuple__': 5} was a bare TypeError,
{'__array__': 5} a bare KeyError) and decoded '__bytes__' without validation ('!!!' loaded as b'')."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import arraycheckpoint as acp  # noqa: E402


def _saved_with(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    root = tmp_path / "ck"
    acp.save(str(root), {"model": {"w": torch.ones(2)}, "extra_state": {"t": torch.arange(3), "tup": (1, 2)}})
    path = tmp_path / "bad"
    shutil.copytree(root, path)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    edit(doc["objects"]["extra_state"]["value"])
    meta.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "edit",
    [
        lambda v: v["tup"].__setitem__("__tuple__", 5),
        lambda v: v["t"].__setitem__("__array__", 5),
        lambda v: v["t"].__setitem__("__array__", "extra_state/not_stored"),
        lambda v: v.__setitem__("d", {"__dict__": 7}),
        lambda v: v.__setitem__("f", {"__float__": "x"}),
    ],
    ids=[
        "tuple of a number",
        "array ref a number",
        "array ref not stored",
        "dict of a number",
        "float of a word",
    ],
)
def test_a_malformed_tag_in_extra_state_is_named(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    path = _saved_with(tmp_path, edit)
    with pytest.raises(acp.InconsistentCheckpointError, match="extra_state"):
        acp.load(str(path), {"model": {"w": torch.zeros(2)}, "extra_state": {}})


def test_bytes_that_are_not_base64_are_refused(tmp_path: Path) -> None:
    path = _saved_with(tmp_path, lambda v: v.__setitem__("b", {"__bytes__": "!!!"}))
    with pytest.raises(acp.InconsistentCheckpointError, match="extra_state"):
        acp.load(str(path), {"model": {"w": torch.zeros(2)}, "extra_state": {}})


def test_a_stored_dict_key_that_cannot_be_one_is_named() -> None:
    """A ``__dict__`` pair whose key decodes to a dict: a clear error, not a bare ``unhashable type``."""
    from arraycheckpoint.format import extras

    with pytest.raises(acp.InconsistentCheckpointError, match="malformed"):
        extras.decode({"__dict__": [[{"a": 1}, 2]]}, {}, where="extra_state")
