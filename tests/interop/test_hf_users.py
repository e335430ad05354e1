"""Hugging Face users with the real ``transformers``: tied embeddings, one-file directories, bytes read.

A tiny ``LlamaForCausalLM`` saved with ``save_pretrained`` (one ``model.safetensors``; a tied
``lm_head.weight`` is stored once, under ``model.embed_tokens.weight``) loads strictly and bit-exactly into
tied and untied models, and into FSDP2 at 2 ranks (the README's example). Every process reads about its own
regions' bytes of a one-file directory, measured from the kernel's count of bytes read (``rchar``), and the
load report says the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.errors import StateMismatchError

transformers = pytest.importorskip("transformers")


def llama_config(tie: bool, vocab: int = 64, hidden: int = 16) -> object:
    """A tiny Llama (2 layers, GQA 2:1)."""
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )


def llama(tie: bool, seed: int, **sizes: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(tie, **sizes))


def save_hf(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _assert_same(model: torch.nn.Module, src: torch.nn.Module) -> None:
    want = src.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    src = llama(True, 0)
    return save_hf(src, tmp_path_factory.mktemp("hf") / "tied"), src


def test_tied_directory_stores_the_weight_once(tied_dir) -> None:
    hf, _ = tied_dir
    names = set(acp.read_metadata(hf).tensors)
    assert "model/model.embed_tokens.weight" in names and "model/lm_head.weight" not in names


@pytest.mark.parametrize("tie", [True, False])
def test_tied_directory_loads_strictly_into_tied_and_untied(tied_dir, tie: bool) -> None:
    hf, src = tied_dir
    model = llama(tie, 1)
    report: dict = {}
    acp.load(hf, {"model": model}, strict=True, report=report)
    _assert_same(model, src)
    assert report["missing"] == report["unexpected"] == []
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie


def test_tied_target_without_config_and_untied_directory(tmp_path: Path, tied_dir) -> None:
    """Without ``config.json`` a tied target still finds its weight under the one stored name; an untied
    directory (both stored) loads into an untied model, and into a tied one only if the two are equal."""
    hf, src = tied_dir
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    model = llama(True, 2)
    acp.load(bare, {"model": model}, strict=True)
    _assert_same(model, src)
    with pytest.raises(StateMismatchError, match="lm_head.weight"):
        acp.load(bare, {"model": llama(False, 2)}, strict=True)  # nothing says lm_head is tied

    untied_src = llama(False, 3)
    untied = save_hf(untied_src, tmp_path / "untied")
    model = llama(False, 4)
    acp.load(untied, {"model": model}, strict=True)
    _assert_same(model, untied_src)
    with pytest.raises(StateMismatchError, match="tied parameter"):
        acp.load(untied, {"model": llama(True, 4)}, strict=True)


# ------------------------------------------------------------------------------------------ bytes read
def _rchar() -> int:
    """Bytes this process has read through read(2)/pread(2) so far (the kernel's count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _read_bytes(report: dict) -> int:
    return sum(p.get("bytes", 0) for p in report["metrics"] if p["phase"] == "read")


def readme_body(rank: int, world: int, hf: str) -> dict:
    """The README's Hugging Face example: FSDP2 at ``world`` ranks, strict, with the bytes each rank reads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = fully_shard(llama(True, 10 + rank, vocab=2048, hidden=64), mesh=mesh)
    acp.load(hf, {"model": model})  # warm: imports and first-use file reads are not counted below
    before = _rchar()
    report: dict = {}
    acp.load(hf, {"model": model}, strict=True, report=report)
    read = _rchar() - before
    full = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
    return {"full": full, "rchar": read, "reported": _read_bytes(report)}


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_readme_example_fsdp2_reads_its_regions_once(tmp_path: Path) -> None:
    """One ``model.safetensors`` (0.6 MiB, the embedding 0.5 MiB of it): each of 2 ranks reads about half
    of it (an existence check that read the whole file made this 1.5x), and the report counts those bytes."""
    src = llama(True, 0, vocab=2048, hidden=64)
    hf = save_hf(src, tmp_path / "hf")
    size = (hf / "model.safetensors").stat().st_size
    want = {k: v.numpy() for k, v in src.state_dict().items()}
    results = run_distributed(readme_body, 2, (str(hf),))
    for r in results:
        assert set(r["full"]) == set(want)
        for k, v in want.items():
            assert np.array_equal(r["full"][k], v), k
        assert r["rchar"] < 0.6 * size, (r["rchar"], size)
        assert r["reported"] <= r["rchar"] <= r["reported"] + 64 * 1024 + 0.05 * size, r
