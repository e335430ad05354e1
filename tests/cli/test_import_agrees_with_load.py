"""``arraycheckpoint import`` of a Hugging Face directory agrees with ``acp.load`` of it (session 20 review)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import run_main

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import arraycheckpoint as acp  # noqa: E402


def test_an_index_listing_a_tensor_its_file_lacks_is_refused_not_dropped(tmp_path: Path, capsys) -> None:
    """The index names ``b`` in ``s1.safetensors``, which holds only ``a``: ``acp.load`` refuses the
    directory; the import used to store ``a`` alone, exit 0, and the tensor was lost without a word."""
    src = tmp_path / "hf"
    src.mkdir()
    safetensors_torch.save_file({"a": torch.arange(6.0).reshape(2, 3)}, str(src / "s1.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})
    )
    with pytest.raises(acp.MetadataError, match="do not hold: b"):
        acp.load(str(src), {"model": {"a": torch.zeros(2, 3), "b": torch.zeros(1)}})
    out = tmp_path / "out"
    code, _out, err = run_main(capsys, "import", src, out)
    assert code == 2, err
    assert "'b'" in err and "s1.safetensors" in err
    assert not os.path.exists(out)


def test_an_index_placing_a_tensor_in_the_wrong_file_is_refused(tmp_path: Path, capsys) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    safetensors_torch.save_file({"a": torch.ones(2)}, str(src / "s1.safetensors"))
    safetensors_torch.save_file({"b": torch.zeros(2)}, str(src / "s2.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors"}})
    )
    code, _out, err = run_main(capsys, "import", src, tmp_path / "out")
    assert code == 2 and "does not hold" in err, err
    assert not (tmp_path / "out").exists()


def test_a_consistent_sharded_directory_still_imports_bit_exactly(tmp_path: Path, capsys) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4, dtype=torch.bfloat16)
    safetensors_torch.save_file({"a": a}, str(src / "s1.safetensors"))
    safetensors_torch.save_file({"b": b}, str(src / "s2.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )
    code, _out, err = run_main(capsys, "import", src, tmp_path / "out")
    assert code == 0, err
    target = {"model": {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}}
    acp.load(str(tmp_path / "out"), target)
    assert torch.equal(target["model"]["a"], a) and torch.equal(target["model"]["b"], b)


@pytest.mark.parametrize("bad", ["", "__metadata__"])
def test_export_refuses_a_key_no_safetensors_reader_accepts(tmp_path: Path, capsys, bad: str) -> None:
    """``--rename`` onto ``__metadata__`` wrote a file that neither safetensors nor ``import`` could read
    ("duplicate field `__metadata__`"), onto ``""`` one that ``import`` refused: both exit 0."""
    ckpt = tmp_path / "ckpt"
    acp.save(str(ckpt), {"model": {"w": torch.ones(2), "b": torch.zeros(3)}})
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"w": bad}))
    code, _out, err = run_main(capsys, "export", ckpt, tmp_path / "out", "--rename", mapping)
    assert code == 2 and repr(bad) in err and "'model/w'" in err, err
    assert not (tmp_path / "out").exists()


def test_import_of_a_tensor_with_more_dimensions_than_a_checkpoint_holds_names_it(
    tmp_path: Path, capsys
) -> None:
    """A header with a 100-dimensional tensor (the safetensors library reads it) was an internal error (exit 3,
    numpy's "maximum supported dimension ... 64")."""
    import struct

    src = tmp_path / "hf"
    src.mkdir()
    header = json.dumps({"deep": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}).encode()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    code, _out, err = run_main(capsys, "import", src, tmp_path / "out")
    assert code == 2 and "'deep'" in err and "100 dimensions" in err, err
    assert not (tmp_path / "out").exists()


def test_import_reads_unsigned_dtypes_acp_load_reads(tmp_path: Path, capsys) -> None:
    """U16/U32/U64 tensors loaded through ``acp.load`` of the directory but ``import`` refused them, and its
    message for a dtype it lacks named neither the tensor nor the file."""
    import struct

    src = tmp_path / "hf"
    src.mkdir()
    tensors = {n: torch.arange(5).to(getattr(torch, n)) for n in ("uint16", "uint32", "uint64")}
    safetensors_torch.save_file(tensors, str(src / "model.safetensors"))
    code, _out, err = run_main(capsys, "import", src, tmp_path / "out")
    assert code == 0, err
    target = {"model": {n: torch.zeros(5, dtype=t.dtype) for n, t in tensors.items()}}
    acp.load(str(tmp_path / "out"), target)
    assert all(torch.equal(target["model"][n], t) for n, t in tensors.items())

    odd = tmp_path / "odd"
    odd.mkdir()
    header = json.dumps({"scales": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (odd / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    code, _out, err = run_main(capsys, "import", odd, tmp_path / "out2")
    assert code == 2 and "'scales'" in err and "model.safetensors" in err and "F8_E8M0" in err, err


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_of_a_dtype_the_output_lacks_names_the_tensor_before_reading(
    tmp_path: Path, capsys, fmt: str
) -> None:
    """float8_e3m4 (JAX checkpoints hold it): safetensors failed after reading everything, naming only its
    temporary file ("cannot write .model-00001-of-00001.safetensors.x.tmp: Unknown dtype"); torch was an
    internal error (KeyError: dtype(float8_e3m4))."""
    import ml_dtypes
    import numpy as np

    ckpt = tmp_path / "ckpt"
    acp.save(str(ckpt), {"model": {"w": np.zeros(4, dtype=ml_dtypes.float8_e3m4), "b": torch.ones(2)}})
    out = tmp_path / ("out" if fmt == "safetensors" else "out.pt")
    code, _out, err = run_main(capsys, "export", ckpt, out, "--format", fmt)
    assert code == 2 and "'model/w'" in err and "float8_e3m4" in err, err
    assert not out.exists() or not any(out.iterdir())
    code, _out, err = run_main(
        capsys, "export", ckpt, out, "--format", fmt, "--dtype", "float16", "--overwrite"
    )
    assert code == 0, err


@pytest.mark.parametrize("dtype", ["int8", "bool"])
def test_export_dtype_must_be_floating_point(tmp_path: Path, capsys, dtype: str) -> None:
    """``--dtype int8`` truncated every float weight to an integer, exit 0."""
    ckpt = tmp_path / "ckpt"
    acp.save(str(ckpt), {"model": {"w": torch.full((2,), 0.7)}})
    code, _out, err = run_main(capsys, "export", ckpt, tmp_path / "out", "--dtype", dtype)
    assert code == 2 and f"--dtype {dtype}" in err, err


def test_import_of_a_torch_file_whose_keys_flatten_to_one_name_is_refused(tmp_path: Path, capsys) -> None:
    """``{"b": {"a": t1}, "b.a": t2}`` imported 2 of its 3 tensors, exit 0: one was overwritten."""
    src = tmp_path / "sd.pt"
    torch.save({"a": torch.ones(2), "b": {"a": torch.zeros(1)}, "b.a": torch.ones(1)}, str(src))
    code, _out, err = run_main(capsys, "import", src, tmp_path / "out")
    assert code == 2 and "'b.a'" in err, err
    assert not (tmp_path / "out").exists()


def test_import_of_a_pickled_module_says_what_the_file_holds(tmp_path: Path, capsys) -> None:
    """The message was torch's first line, with terminal escapes, and no word of what was in the file."""
    src = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(2, 2), str(src))
    code, _out, err = run_main(capsys, "import", src, tmp_path / "out")
    assert code == 2 and "torch.nn.modules.linear.Linear" in err and "\x1b[" not in err, err
