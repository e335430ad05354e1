"""``dcp.load`` through ``acp.dcp.Reader`` over a checkpoint ``acp.save`` wrote (or a save_pretrained directory)
gets everything DCP's own reader gives for a FileSystemWriter directory of the same state: an optimizer's
``param_groups`` (as ``get_state_dict`` lays them out, and flattened as torchtitan saves them), plain values
such as ``extra_state.step``, and tied weights stored once (``model.lm_head.weight``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import arraycheckpoint as acp
import arraycheckpoint.dcp  # noqa: F401 - acp.dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": lr}, {"params": model[2].parameters(), "lr": lr / 2}],
        weight_decay=0.25,
    )
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def _extra(step: int) -> dict:
    return {
        "step": step,
        "epoch": step // 10,
        "name": f"run{step}",
        "t": torch.tensor(step),
        "n": {"a": [step, 1]},
    }


@pytest.mark.parametrize("flatten", [False, True])
def test_optimizer_and_plain_values_come_back_as_from_filesystemreader(tmp_path: Path, flatten: bool) -> None:
    model, opt = _trained(0, 0.01)
    acp.save(str(tmp_path / "acp"), {"model": model, "optimizer": opt, "extra_state": _extra(100)})
    opts = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": msd, "optimizer": osd, "extra_state": _extra(100)},
            storage_writer=FileSystemWriter(str(tmp_path / "fsw")),
        )

    def resumed(reader: object) -> tuple[dict, dict]:
        m2, o2 = _trained(1, 0.5)
        msd2, osd2 = get_state_dict(m2, o2, options=opts)
        state = {"model": msd2, "optimizer": osd2, "extra_state": _extra(0)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader)
        set_state_dict(
            m2, o2, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=opts
        )
        return {"model": m2.state_dict(), "optimizer": o2.state_dict()}, state["extra_state"]

    want, want_extra = resumed(FileSystemReader(str(tmp_path / "fsw")))
    got, got_extra = resumed(acp.dcp.Reader(str(tmp_path / "acp")))
    assert got_extra == want_extra == _extra(100)
    assert (
        got["optimizer"]["param_groups"]
        == want["optimizer"]["param_groups"]
        == opt.state_dict()["param_groups"]
    )
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for p, st in want["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][p][k], v), (p, k)


def _tied_llama(seed: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def test_tied_weights_come_back_through_the_reader(tmp_path: Path) -> None:
    model = _tied_llama(0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    acp.save(str(tmp_path / "acp"), {"model": model})
    model.save_pretrained(str(tmp_path / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, storage_writer=FileSystemWriter(str(tmp_path / "fsw")))
    for reader in [
        FileSystemReader(str(tmp_path / "fsw")),
        acp.dcp.Reader(str(tmp_path / "acp")),
        acp.dcp.Reader(str(tmp_path / "hf")),
    ]:
        got = _tied_llama(1)
        state = {"model": got.state_dict()}
        assert "lm_head.weight" in state["model"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader)
        for k, v in model.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), (type(reader).__name__, k)
