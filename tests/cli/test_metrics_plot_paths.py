"""``arraycheckpoint metrics --plot`` never writes into the checkpoint, and a bad image name is a usage error
(session 20 review: ``--plot CKPT/model/w/c/0`` replaced a chunk file with a PNG; ``--plot out.json`` was an
internal error, exit 3)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_helpers import run_main

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

import arraycheckpoint as acp  # noqa: E402


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    acp.save(str(path), {"model": {"w": torch.arange(6.0).reshape(2, 3)}})
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): Path(d, f).read_bytes()
        for d, _dirs, files in os.walk(root)
        for f in files
    }


@pytest.mark.parametrize("inside", ["model/w/c/0", "metrics.png", ".acp/committed"])
def test_a_plot_inside_the_checkpoint_is_refused_and_changes_nothing(ckpt: Path, capsys, inside: str) -> None:
    before = _files(ckpt)
    code, _out, err = run_main(capsys, "metrics", ckpt, "--plot", ckpt / inside)
    assert code == 2 and "inside the checkpoint" in err, err
    assert _files(ckpt) == before
    assert run_main(capsys, "verify", ckpt)[0] == 0


def test_an_image_format_matplotlib_lacks_is_a_usage_error(ckpt: Path, tmp_path: Path, capsys) -> None:
    code, _out, err = run_main(capsys, "metrics", ckpt, "--plot", tmp_path / "out.json")
    assert code == 2 and "'json'" in err and "out.json" in err, err
    assert not (tmp_path / "out.json").exists()


def test_a_plot_replaces_a_link_without_writing_through_it(ckpt: Path, tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep")
    link = tmp_path / "plot.png"
    link.symlink_to(victim)
    code, _out, err = run_main(capsys, "metrics", ckpt, "--plot", link)
    assert code == 0, err
    assert victim.read_bytes() == b"keep"
    assert not link.is_symlink() and link.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_diff_of_a_namespace_neither_checkpoint_holds_is_an_error_not_identical(ckpt: Path, capsys) -> None:
    """``diff A B --namespace modle`` compared 0 tensors and said "identical" (exit 0)."""
    code, out, err = run_main(capsys, "diff", ckpt, ckpt, "--namespace", "modle")
    assert code == 2 and "'modle'" in err and "model" in err, (out, err)
    code, out, err = run_main(capsys, "diff", ckpt, ckpt, "--namespace", "model")
    assert code == 0 and "identical (1 tensors compared)" in out, (out, err)


def test_diff_json_is_strict_json_when_a_difference_is_infinite(tmp_path: Path, capsys) -> None:
    """NaN against a number counts as an infinite difference; ``--json`` printed ``Infinity`` (jq: parse error)."""
    import json

    a, b = tmp_path / "a", tmp_path / "b"
    acp.save(str(a), {"model": {"w": torch.ones(2)}})
    acp.save(str(b), {"model": {"w": torch.tensor([float("nan"), 1.0])}})
    code, out, err = run_main(capsys, "diff", a, b, "--json")
    assert code == 1, err

    def refuse(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")

    doc = json.loads(out, parse_constant=refuse)
    assert doc["tensors"][0]["max_abs_diff"] == "inf" and doc["tensors"][0]["differing"] == 1


@pytest.mark.parametrize("text", ["[1", "[" * 200 + "]" * 200], ids=["cut short", "200 deep"])
def test_a_bad_mapping_file_does_not_blame_the_checkpoint(
    ckpt: Path, tmp_path: Path, capsys, text: str
) -> None:
    """The error said "...; the checkpoint is damaged" about the user's own --map file."""
    mapping = tmp_path / "map.json"
    mapping.write_text(text)
    before = _files(ckpt)
    code, _out, err = run_main(capsys, "rename", ckpt, "--map", mapping)
    assert code == 2 and str(mapping) in err and "checkpoint is damaged" not in err, err
    assert _files(ckpt) == before
