"""The Hugging Face and DCP sources and the pack parser refuse hostile files with the native load's answers:
a link or a FIFO is a ``CorruptCheckpointError`` naming it, before anything is read through it (a FIFO is
never waited on); deep, non-UTF-8 or truncated documents and data are a ``CorruptCheckpointError`` naming
the file (and the tensor). In process, on the fuzz corpus's builders (the fuzz suite drives the same items
through every entry point in isolated workers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faults.packtools import rescuing_fifo
from fuzz.corpus import ITEMS, build_bases, make_outside, tensors

import arraycheckpoint as acp
from arraycheckpoint.errors import CorruptCheckpointError, InconsistentCheckpointError


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sources")
    build_bases(root / "bases")
    outside = root / "outside"
    make_outside(outside)

    def make(name: str) -> Path:
        dest = root / name
        if not dest.exists():
            ITEMS[name].build(dest, outside)
        return dest

    return make


def _load(path: Path, **kw) -> None:
    acp.load(path, {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4)}}, **kw)


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("hf_shard_link", CorruptCheckpointError, ("model-00001-of-00002.safetensors is a symlink",)),
        ("hf_single_link", CorruptCheckpointError, ("model.safetensors is a symlink",)),
        (
            "hf_shard_fifo",
            CorruptCheckpointError,
            ("model-00001-of-00002.safetensors is not a regular file",),
        ),
        ("hf_index_fifo", CorruptCheckpointError, ("model.safetensors.index.json is not a regular file",)),
        ("hf_index_deep", InconsistentCheckpointError, ("model.safetensors.index.json nests JSON",)),
        ("hf_header_deep", InconsistentCheckpointError, ("model.safetensors (its header) nests JSON",)),
        (
            "hf_index_non_utf8",
            InconsistentCheckpointError,
            ("model.safetensors.index.json is not valid JSON",),
        ),
        ("hf_index_nul_name", acp.errors.MetadataError, ("index.json", "unsafe file", "model-0\\x00")),
        ("hf_two_bytes", InconsistentCheckpointError, ("model.safetensors is 2 bytes",)),
        (
            "hf_header_past_eof",
            InconsistentCheckpointError,
            ("claims a 1048576-byte header", "holds 10 bytes"),
        ),
        ("hf_cut_half", InconsistentCheckpointError, ("model.safetensors: tensor", "the file is truncated")),
        (
            "dcp_cut_half",
            CorruptCheckpointError,
            ("__0_0.distcp is", "the file is truncated", "tensor 'model/"),
        ),
        ("dcp_cut_0", CorruptCheckpointError, ("__0_0.distcp is 0 bytes", "tensor 'model/")),
        ("dcp_distcp_link", CorruptCheckpointError, ("__0_0.distcp is a symlink", "tensor 'model/")),
        ("dcp_distcp_fifo", CorruptCheckpointError, ("__0_0.distcp is not a regular file",)),
        # a file of values only: checked like the tensors' files before the values are read
        ("dcp_value_link", CorruptCheckpointError, ("value 'note'", "__0_2.distcp is a symlink")),
        ("dcp_value_fifo", CorruptCheckpointError, ("value 'note'", "__0_2.distcp is not a regular file")),
        (
            "dcp_value_cut",
            CorruptCheckpointError,
            ("value 'note'", "__0_2.distcp is", "the file is truncated"),
        ),
        ("pack_unicode_path", CorruptCheckpointError, ("Unicode Path extra field", "0.0.zip")),
    ],
)
def test_hostile_source_files_are_refused_naming_them(build, name: str, error: type, words: tuple) -> None:
    path = build(name)
    fifo = next((p for p in path.iterdir() if p.is_fifo()), None)
    with rescuing_fifo(fifo or path / "none") as rescued, pytest.raises(error) as info:
        _load(path, allow_pickle=name.startswith("dcp"))
    assert not rescued.is_set(), "the load waited on a FIFO"
    for w in (str(path), *words):
        assert w in str(info.value), (w, str(info.value))


def test_sources_still_load_valid_directories_bit_exactly(build, tmp_path: Path) -> None:
    """The checks cost nothing to a valid directory: both HF layouts and DCP load bit-exactly."""
    from fuzz.corpus import _BASE_CACHE

    want = tensors()
    for base in ("hf1", "hf2", "dcp", "dcpv"):
        target = {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4)}}
        acp.load(_BASE_CACHE[base], target, allow_pickle=base.startswith("dcp"), strict=base != "dcpv")
        assert torch.equal(target["model"]["w"], want["w"]) and torch.equal(
            target["model"]["b"], want["b"]
        ), base
