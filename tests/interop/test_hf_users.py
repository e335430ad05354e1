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


def readme_body(rank: int, world: int, hf: str, ckpt: str) -> dict:
    """The README's Hugging Face example: FSDP2 at ``world`` ranks, strict, with the bytes each rank reads;
    then the FSDP2 model is saved with acp.save (for the export tests)."""
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
    acp.save(ckpt, {"model": model})
    return {"full": full, "rchar": read, "reported": _read_bytes(report)}


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module, list[dict]]:
    """A one-file HF directory of a tied tiny Llama, loaded (README example) and saved by FSDP2 at 2 ranks."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    src = llama(True, 0, vocab=2048, hidden=64)
    hf = save_hf(src, tmp / "hf")
    results = run_distributed(readme_body, 2, (str(hf), str(tmp / "ckpt")))
    return hf, tmp / "ckpt", src, results


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_readme_example_fsdp2_reads_its_regions_once(fsdp2_run) -> None:
    """One ``model.safetensors`` (0.6 MiB, the embedding 0.5 MiB of it): each of 2 ranks reads about half
    of it (an existence check that read the whole file made this 1.5x), and the report counts those bytes."""
    hf, _, src, results = fsdp2_run
    size = (hf / "model.safetensors").stat().st_size
    want = {k: v.numpy() for k, v in src.state_dict().items()}
    for r in results:
        assert set(r["full"]) == set(want)
        for k, v in want.items():
            assert np.array_equal(r["full"][k], v), k
        assert r["rchar"] < 0.6 * size, (r["rchar"], size)
        assert r["reported"] <= r["rchar"] <= r["reported"] + 64 * 1024 + 0.05 * size, r


# ------------------------------------------------------------------------------------------ export
def _export(*argv: str) -> None:
    from arraycheckpoint.cli import main

    assert main(["export", *argv]) == 0


@pytest.mark.multiprocess
def test_export_of_fsdp2_checkpoint_loads_in_transformers(fsdp2_run, tmp_path: Path) -> None:
    """config.json and generation_config.json come from what acp.save stored for the transformers model;
    the tied weight is written once; the index holds no absolute path; from_pretrained is bit-exact."""
    import json

    _, ckpt, src, _ = fsdp2_run
    out = tmp_path / "out"
    _export(str(ckpt), str(out))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(os.listdir(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert str(tmp_path) not in json.dumps(index) and not os.path.isabs(index["metadata"]["source"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    _assert_same(model, src)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_export_with_config_and_pattern_rename(tmp_path: Path, tied_dir) -> None:
    """A checkpoint with no stored config (a plain state dict under other names): --config copies the HF
    directory's files, {i} and re: rename rules map the names, and transformers loads the result."""
    hf, src = tied_dir
    sd = {k.replace("model.layers.", "blocks.").replace("model.", ""): v for k, v in src.state_dict().items()}
    sd.pop("lm_head.weight")
    acp.save(tmp_path / "ckpt", {"model": sd})
    rules = {
        "blocks.{i}.self_attn.{p}.weight": "model.layers.{i}.self_attn.{p}.weight",
        r"re:blocks\.(\d+)\.(mlp|input_layernorm|post_attention_layernorm)\.(.*)": r"model.layers.\1.\2.\3",
        "embed_tokens.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    (tmp_path / "rename.json").write_text(__import__("json").dumps(rules))
    out = tmp_path / "out"
    _export(str(tmp_path / "ckpt"), str(out), "--config", str(hf), "--rename", str(tmp_path / "rename.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    _assert_same(model, src)
    (tmp_path / "bad.json").write_text('{"nothing.{i}.here": "x"}')
    from arraycheckpoint.cli import main

    assert (
        main(["export", str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--rename", str(tmp_path / "bad.json")])
        == 2
    )


def test_import_export_and_diff_round_trip_of_a_transformers_model(tmp_path: Path, tied_dir) -> None:
    """``arraycheckpoint import`` of an HF directory dropped its config.json (a later ``export`` wrote none,
    and ``from_pretrained`` could not load it) and its tied weight (the imported checkpoint did not load into
    an untied model); a checkpoint exported and imported back differed from itself (``diff`` exit 1:
    ``model/~hf_config`` and ``model/~aliases`` "only in A"). The import keeps both, as ``acp.load`` of the
    directory reads them."""
    from arraycheckpoint.cli import main

    hf, src = tied_dir
    assert main(["import", str(hf), str(tmp_path / "imported")]) == 0
    untied = llama(False, 5)
    acp.load(tmp_path / "imported", {"model": untied}, strict=True)
    _assert_same(untied, src)
    assert main(["export", str(tmp_path / "imported"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")), src)

    # an HF directory exported as it is (re-sharded): its own config, the tied weight written once
    assert main(["export", str(hf), str(tmp_path / "resharded"), "--max-shard-size", "20KB"]) == 0
    assert (tmp_path / "resharded" / "config.json").is_file()
    index = __import__("json").loads((tmp_path / "resharded" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "resharded")), src)

    acp.save(tmp_path / "ckpt", {"model": llama(True, 0)})
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out2")]) == 0
    assert main(["import", str(tmp_path / "out2"), str(tmp_path / "back")]) == 0
    assert main(["diff", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0


# ------------------------------------------------------------------------------------------ accelerate
def test_accelerate_prepared_objects_save_and_load(tmp_path: Path) -> None:
    """accelerate's save_state hard-codes FileSystemWriter; acp.save/acp.load take its prepared model and
    optimizer as they are (docs/integrations.md)."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model = llama(False, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03)
    model, opt = acc.prepare(model, opt)
    out = model(torch.arange(8).reshape(1, 8)).logits.sum()
    acc.backward(out)
    opt.step()
    acp.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2 = llama(False, 1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2, opt2 = acc.prepare(model2, opt2)
    acp.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2}, strict=True)
    _assert_same(acc.unwrap_model(model2), acc.unwrap_model(model))
    inner, inner2 = opt.optimizer, opt2.optimizer
    for p, p2 in zip(acc.unwrap_model(model).parameters(), acc.unwrap_model(model2).parameters()):
        for k, v in inner.state[p].items():
            assert torch.equal(v, inner2.state[p2][k]), k
    assert inner2.param_groups[0]["lr"] == 0.03
