"""A Hugging Face hub cache snapshot loads: every file of ``snapshots/<commit>/`` is a link into ``blobs/``.

``from_pretrained`` and ``snapshot_download`` leave a model in the hub cache as links; ``acp.load`` refused
every one of them ("is a symlink"), so the most common place a model comes from did not load. The cache is
laid out here as ``huggingface_hub`` lays it out (relative links ``../../blobs/<sha256>``), checked by
loading it with ``transformers.from_pretrained(cache_dir=..., local_files_only=True)``. Only that one shape
of link is followed; any other link still is refused, naming it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.cli import EXIT_OK, EXIT_USAGE, main
from arraycheckpoint.errors import CorruptCheckpointError

transformers = pytest.importorskip("transformers")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def llama(seed: int, tie: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def hub_cache(cache: Path, repo_id: str, files: Path) -> Path:
    """The hub cache entry of ``repo_id`` holding ``files``: ``blobs/<sha256>`` and a snapshot of links."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(files.iterdir()):
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return snapshot


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_hub_cache_snapshot_loads_like_the_directory(tmp_path: Path, shard: str | None) -> None:
    src = llama(0)
    kwargs = {"max_shard_size": shard} if shard else {}
    src.save_pretrained(tmp_path / "saved", **kwargs)
    snapshot = hub_cache(tmp_path / "cache", "tiny/llama", tmp_path / "saved")
    assert all(p.is_symlink() for p in snapshot.iterdir())
    assert (snapshot / "model.safetensors.index.json").is_symlink() == bool(shard)
    via_hf = transformers.LlamaForCausalLM.from_pretrained(
        "tiny/llama", cache_dir=tmp_path / "cache", local_files_only=True
    )  # the layout is the hub's
    for model in (llama(1), llama(2, tie=False)):
        report: dict = {}
        acp.load(snapshot, {"model": model}, strict=True, report=report)  # lm_head tied through config.json
        assert report["missing"] == report["unexpected"] == []
        for k, v in model.state_dict().items():
            assert torch.equal(v, src.state_dict()[k]) and torch.equal(v, via_hf.state_dict()[k]), k
    assert main(["import", str(snapshot), str(tmp_path / "imported")]) == EXIT_OK
    model = llama(3)
    acp.load(tmp_path / "imported", {"model": model}, strict=False)
    assert torch.equal(model.model.embed_tokens.weight, src.model.embed_tokens.weight)


def _snapshot_with(tmp_path: Path, plant) -> Path:
    """A one-file snapshot whose ``model.safetensors`` link ``plant(snapshot, blobs, blob)`` replaces."""
    src = llama(0)
    src.save_pretrained(tmp_path / "saved")
    snapshot = hub_cache(tmp_path / "cache", "tiny/llama", tmp_path / "saved")
    blob = Path(os.path.realpath(snapshot / "model.safetensors"))
    os.unlink(snapshot / "model.safetensors")
    plant(snapshot, blob.parent, blob)
    return snapshot


def _outside(snapshot: Path, blobs: Path, blob: Path) -> None:
    outside = blobs.parent.parent / "outside.safetensors"  # beside the repository folder
    shutil.copyfile(blob, outside)
    os.symlink(os.path.relpath(outside, snapshot), snapshot / "model.safetensors")


def _absolute_elsewhere(snapshot: Path, blobs: Path, blob: Path) -> None:
    other = blobs.parent.parent / "elsewhere"
    other.mkdir()
    shutil.copyfile(blob, other / blob.name)
    os.symlink(other / blob.name, snapshot / "model.safetensors")


def _blobs_is_a_link(snapshot: Path, blobs: Path, blob: Path) -> None:
    moved = blobs.parent.parent / "real_blobs"
    os.rename(blobs, moved)
    os.symlink(moved, blobs)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "model.safetensors")


def _blob_is_a_link(snapshot: Path, blobs: Path, blob: Path) -> None:
    outside = blobs.parent.parent / "outside.safetensors"
    os.rename(blob, outside)
    os.symlink(outside, blob)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "model.safetensors")


def _blob_is_a_fifo(snapshot: Path, blobs: Path, blob: Path) -> None:
    os.unlink(blob)
    os.mkfifo(blob)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "model.safetensors")


@pytest.mark.parametrize(
    "plant", [_outside, _absolute_elsewhere, _blobs_is_a_link, _blob_is_a_link, _blob_is_a_fifo]
)
def test_any_other_link_in_a_snapshot_is_refused(tmp_path: Path, capsys, plant) -> None:
    snapshot = _snapshot_with(tmp_path, plant)
    box: dict = {}

    def attempt() -> None:
        try:
            acp.load(snapshot, {"model": llama(1)})
        except CorruptCheckpointError as e:
            box["load"] = str(e)
        box["import"] = main(["import", str(snapshot), str(tmp_path / "imported")])

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "blocked on a FIFO"
    assert "model.safetensors" in box["load"] or "blobs" in box["load"]
    assert box["import"] == EXIT_USAGE and not (tmp_path / "imported").exists()
    assert "Traceback" not in capsys.readouterr().err


def test_the_cache_folder_itself_names_its_snapshot(tmp_path: Path) -> None:
    llama(0).save_pretrained(tmp_path / "saved")
    snapshot = hub_cache(tmp_path / "cache", "tiny/llama", tmp_path / "saved")
    for wrong in (snapshot.parent.parent, snapshot.parent):
        with pytest.raises(acp.CheckpointNotFoundError, match="hub cache folder: load a snapshot") as e:
            acp.load(wrong, {"model": llama(1)})
        assert str(snapshot) in str(e.value)


def test_a_directory_of_torch_save_weights_says_how_to_convert_it(tmp_path: Path) -> None:
    """An older Hugging Face repository holds only ``pytorch_model.bin``: the error says how to convert it."""
    torch.save(llama(0).state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(acp.CheckpointNotFoundError, match="arraycheckpoint import .*pytorch_model.bin"):
        acp.load(tmp_path, {"model": llama(1)})
