"""A Hugging Face directory whose keys transformers converts at load (Mixtral's per-expert weights, fused in
transformers 5) is refused with the reason and the way through, not only a list of 16 keys (session 20 review)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")

import arraycheckpoint as acp  # noqa: E402


def _mixtral() -> object:
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def test_a_directory_transformers_converts_says_how_to_load_it(tmp_path: Path) -> None:
    model = _mixtral()
    model.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(acp.StateMismatchError) as info:
        acp.load(str(tmp_path / "hf"), {"model": _mixtral()})
    text = str(info.value)
    assert "block_sparse_moe" in text  # the keys are still listed
    assert "'mixtral'" in text and "MixtralForCausalLM.from_pretrained" in text
    # the way the message names works, bit-exactly
    loaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf"))
    acp.save(str(tmp_path / "ckpt"), {"model": loaded})
    target = _mixtral()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    acp.load(str(tmp_path / "ckpt"), {"model": target})
    for (name, a), b in zip(model.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
