"""Defects the attack3 review found in modules other engineers own now (format/): each test fails today and is
marked ``xfail(strict=True)``; the fix belongs in ``arraycheckpoint/format/extras.py`` (``decode``), which every
reader of stored JSON values goes through (torch and JAX extra state, optimizer param groups, stateful objects,
megatron extra state, DCP values)."""

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


@pytest.mark.xfail(
    strict=True,
    reason="format/extras.decode trusts its tags: {'__tuple__': 5} is a bare TypeError, {'__array__': 5} a bare "
    "KeyError (not an InconsistentCheckpointError naming the entry)",
)
@pytest.mark.parametrize(
    "edit",
    [
        lambda v: v["tup"].__setitem__("__tuple__", 5),
        lambda v: v["t"].__setitem__("__array__", 5),
        lambda v: v.__setitem__("d", {"__dict__": 7}),
        lambda v: v.__setitem__("f", {"__float__": "x"}),
    ],
    ids=["tuple of a number", "array ref a number", "dict of a number", "float of a word"],
)
def test_a_malformed_tag_in_extra_state_is_named(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    path = _saved_with(tmp_path, edit)
    with pytest.raises(acp.InconsistentCheckpointError, match="extra_state"):
        acp.load(str(path), {"model": {"w": torch.zeros(2)}, "extra_state": {}})


@pytest.mark.xfail(
    strict=True,
    reason="format/extras.decode decodes __bytes__ with base64.b64decode(validate=False): '!!!' loads as b'' "
    "without a word (a damaged bytes value is silently replaced)",
)
def test_bytes_that_are_not_base64_are_refused(tmp_path: Path) -> None:
    path = _saved_with(tmp_path, lambda v: v.__setitem__("b", {"__bytes__": "!!!"}))
    with pytest.raises(acp.InconsistentCheckpointError, match="extra_state"):
        acp.load(str(path), {"model": {"w": torch.zeros(2)}, "extra_state": {}})
