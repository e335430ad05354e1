"""A torch dtype the format lacks is refused naming the tensor, on save and on load (session 20 review: the
message named only the dtype, "torch dtype torch.float8_e8m0fnu has no checkpoint representation", and a
model holds hundreds of tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import arraycheckpoint as acp  # noqa: E402

E8M0 = getattr(torch, "float8_e8m0fnu", None)


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
def test_save_of_a_module_with_an_unsupported_buffer_names_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    model.register_buffer("scales", torch.zeros(4, dtype=torch.uint8).view(E8M0))
    with pytest.raises(acp.UnsupportedDTypeError, match=r"model/scales: .*float8_e8m0fnu"):
        acp.save(str(tmp_path / "c"), {"model": model})
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
def test_load_into_an_unsupported_target_dtype_names_it(tmp_path: Path) -> None:
    acp.save(str(tmp_path / "c"), {"model": {"scales": torch.ones(4, dtype=torch.uint8), "w": torch.ones(2)}})
    target = {"model": {"scales": torch.zeros(4, dtype=torch.uint8).view(E8M0), "w": torch.zeros(2)}}
    with pytest.raises(acp.UnsupportedDTypeError, match=r"scales.*float8_e8m0fnu"):
        acp.load(str(tmp_path / "c"), target)
    assert torch.equal(target["model"]["w"], torch.zeros(2))  # refused before anything was read


@pytest.mark.parametrize("bad", [-5, "x", 1.5, True])
def test_prepare_refuses_a_pinned_budget_that_is_not_a_byte_count(bad: object) -> None:
    """``pinned_bytes="x"`` was a bare ValueError from int(); -5 and 1.5 were taken as given."""
    with pytest.raises(acp.InvalidArgumentError, match="pinned_bytes"):
        acp.prepare({"model": torch.nn.Linear(2, 2)}, pinned_bytes=bad)


@pytest.mark.parametrize("bad", [None, [1]])
def test_prepare_refuses_a_state_that_is_not_a_mapping(bad: object) -> None:
    """Was AttributeError: 'NoneType' object has no attribute 'items'."""
    with pytest.raises(acp.InvalidStateError, match="mapping"):
        acp.prepare(bad)  # type: ignore[arg-type]
