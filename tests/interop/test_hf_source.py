"""Hugging Face safetensors directories as a load source: ``acp.load(hf_dir, state)`` into any layout.

The directories are written with ``safetensors`` itself (index + two shards, or one ``model.safetensors``).
Every load is compared bit-exactly with the source tensors, and every rank's bytes read from storage are
checked against the bytes of its own regions (at most 1.1x).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import MetadataError, StateMismatchError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax"))
from dist import run_distributed  # noqa: E402
from jaxrun import run_jax  # noqa: E402

MAX_OVERREAD = 1.1


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Embedding(50, 12), torch.nn.Linear(12, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7)
    )
    return m.to(dtype)


def write_hf(path: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """A Hugging Face directory: ``model.safetensors`` (one shard) or an index and ``shards`` files."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in keys}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: tensors[k].contiguous() for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return path


def _read_phase(report: dict) -> dict:
    (phase,) = [p for p in report["metrics"] if p["phase"] == "read"]
    return phase


@pytest.fixture()
def hf_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = {k: v.detach().clone() for k, v in _model(0).state_dict().items()}
    return write_hf(tmp_path / "hf", src), src


# ------------------------------------------------------------------------------------------ one process
def test_plain_module_strict_key_map_cast_and_report(tmp_path: Path) -> None:
    src = {k: v.detach().clone() for k, v in _model(0, torch.bfloat16).state_dict().items()}
    hf = write_hf(tmp_path / "hf", src, shards=1)
    target = _model(1, torch.bfloat16)
    report: dict = {}
    acp.load(hf, {"model": target}, report=report)
    for k, v in target.state_dict().items():
        assert torch.equal(v.view(torch.int16), src[k].view(torch.int16)), k
    assert report["missing"] == report["unexpected"] == report["mismatched"] == []
    phase = _read_phase(report)
    assert phase["bytes"] == phase["wanted_bytes"] == sum(t.numel() * 2 for t in src.values())

    f32 = _model(2)
    with pytest.raises(StateMismatchError, match="allow_cast"):
        acp.load(hf, {"model": f32})
    acp.load(hf, {"model": f32}, allow_cast=True)
    for k, v in f32.state_dict().items():
        assert torch.equal(v, src[k].float()), k

    # key_map: a module whose names differ from the file's
    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 12, dtype=torch.bfloat16)
            self.proj = torch.nn.Linear(12, 13, dtype=torch.bfloat16)

    renamed = Renamed()
    names = {"model/embed.weight": "model/0.weight", "model/proj.weight": "model/1.weight"}
    names["model/proj.bias"] = "model/1.bias"
    report = {}
    acp.load(hf, {"model": renamed}, key_map=names, strict=False, report=report)
    assert torch.equal(renamed.proj.weight, src["1.weight"]) and torch.equal(
        renamed.embed.weight, src["0.weight"]
    )
    assert report["unexpected"] == ["model/3.bias", "model/3.weight"]
    with pytest.raises(StateMismatchError, match="model/3.weight"):
        acp.load(hf, {"model": Renamed()}, key_map=names)


def test_sharded_directory_and_hostile_headers(hf_dir, tmp_path: Path) -> None:
    hf, src = hf_dir
    target = _model(3)
    acp.load(hf, {"model": target})
    for k, v in target.state_dict().items():
        assert torch.equal(v, src[k]), k
    meta = acp.read_metadata(hf)
    assert meta.framework == "safetensors" and set(meta.tensors) == {f"model/{k}" for k in src}

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(MetadataError, match="header"):
        acp.load(bad, {"model": _model(0)})
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4]}}).encode()
    (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(MetadataError, match="needs 4194304"):
        acp.read_metadata(bad)
    evil = tmp_path / "evil"
    write_hf(evil, {"w": torch.zeros(2)})
    (evil / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(MetadataError, match="unsafe file"):
        acp.read_metadata(evil)


# ------------------------------------------------------------------------------------------ FSDP2 / FSDP1
def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def fsdp2_body(rank: int, world: int, hf: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _model(100 + rank)
    mesh = _mesh(world)
    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report: dict = {}
    acp.load(hf, {"model": model}, report=report)
    own = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor))
    full = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
    return {"full": full, "read": _read_phase(report), "own": own}


def fsdp1_body(rank: int, world: int, hf: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(100 + rank), use_orig_params=True, device_id=torch.device("cpu"))
    report: dict = {}
    acp.load(hf, {"model": model}, report=report)
    with FSDP.summon_full_params(model):
        full = {k: v.detach().clone().numpy() for k, v in model.module.state_dict().items()}
    return {"full": full, "read": _read_phase(report)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,world", [("fsdp2", 3), ("fsdp1", 2)])
def test_hf_into_fsdp(hf_dir, kind: str, world: int) -> None:
    hf, src = hf_dir
    body = fsdp2_body if kind == "fsdp2" else fsdp1_body
    results = run_distributed(body, world, (str(hf),))
    for r in results:
        for k, v in src.items():
            assert np.array_equal(r["full"][k], v.numpy()), (kind, k)
        read = r["read"]
        assert 0 < read["bytes"] <= MAX_OVERREAD * read["wanted_bytes"], read
        if "own" in r:
            assert read["wanted_bytes"] == r["own"]
    total = sum(t.numel() * t.element_size() for t in src.values())
    assert sum(r["read"]["bytes"] for r in results) <= MAX_OVERREAD * total


# ------------------------------------------------------------------------------------------ megatron TP=2
def _hf_key(key: str) -> str:
    """How the test's Hugging Face file names megatron's (stacked) tensors."""
    return "hf." + key.replace("decoder.layers.", "blocks.")


def megatron_shards(rank: int, world: int) -> list:
    from megatron_helpers import build_gpt, fill_model, local_shards

    model = build_gpt(2, 1, seed=rank)
    fill_model(model)
    return local_shards(model)


def megatron_load(rank: int, world: int, hf: str) -> tuple:
    from megatron_helpers import build_gpt, local_shards

    model = build_gpt(2, 1, seed=100 + rank)
    before = local_shards(model)
    report: dict = {}
    key_map = lambda name: "model/" + _hf_key(name.split("/", 1)[1]) if name.startswith("model/") else name  # noqa: E731
    acp.load(hf, {"model": model}, key_map=key_map, strict=False, report=report, framework="megatron")
    return before, local_shards(model), _read_phase(report), report["missing"], report["unexpected"]


def megatron_strict_load(rank: int, world: int, hf: str, partial: str) -> tuple:
    from megatron_helpers import build_gpt, local_shards

    model = build_gpt(2, 1, seed=100 + rank)
    key_map = lambda name: "model/" + _hf_key(name.split("/", 1)[1]) if name.startswith("model/") else name  # noqa: E731
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    report: dict = {}
    acp.load(hf, {"model": model}, key_map=key_map, report=report, framework="megatron")  # strict
    kept = all(model.state_dict()[k] is v or model.state_dict()[k] == v for k, v in extra.items())
    try:  # strict still refuses a tensor the directory lacks, and names it alone
        acp.load(partial, {"model": build_gpt(2, 1, seed=7)}, key_map=key_map, framework="megatron")
        refused = ""
    except StateMismatchError as e:
        refused = str(e)
    return local_shards(model), report["missing"], bool(extra) and kept, refused


@pytest.mark.multiprocess
def test_hf_into_megatron_strict_expects_no_extra_state(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
    from megatron_helpers import assemble, assert_equal_tensors

    source = assemble(run_distributed(megatron_shards, 2))
    hf_tensors = {_hf_key(k): torch.from_numpy(v) for k, v in source.items()}
    hf = write_hf(tmp_path / "hf", hf_tensors, shards=3)
    dropped = sorted(hf_tensors)[0]
    partial = write_hf(tmp_path / "partial", {k: v for k, v in hf_tensors.items() if k != dropped}, shards=2)
    results = run_distributed(megatron_strict_load, 2, (str(hf), str(partial)))
    assert_equal_tensors(assemble([r[0] for r in results]), source)
    for _shards, missing, kept, refused in results:
        assert missing == [] and kept
        assert f"model/{dropped}" in refused and "_extra_state" not in refused, refused


@pytest.mark.multiprocess
def test_hf_into_megatron_tp2_with_key_map(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
    from megatron_helpers import assemble, assert_equal_tensors

    source = assemble(run_distributed(megatron_shards, 2))
    hf = write_hf(tmp_path / "hf", {_hf_key(k): torch.from_numpy(v) for k, v in source.items()}, shards=3)
    results = run_distributed(megatron_load, 2, (str(hf),))
    before = assemble([r[0] for r in results], replicas_agree=False)
    assert all(not np.array_equal(before[k], source[k]) for k in source)
    assert_equal_tensors(assemble([r[1] for r in results]), source)
    for _before, _after, read, missing, unexpected in results:
        assert 0 < read["bytes"] <= MAX_OVERREAD * read["wanted_bytes"], read
        assert unexpected == [] and all("_extra_state" in m for m in missing), missing


# ------------------------------------------------------------------------------------------ JAX 2x4 mesh
JAX_LAYOUT = {  # name: (shape, dtype, partition spec)
    "embed.weight": ((24, 16), "bfloat16", ("b", "a")),
    "proj.weight": ((16, 8), "float32", ("a", "b")),
    "proj.bias": ((8,), "float32", ("b",)),
    "head.weight": ((8, 12), "float32", (None, "b")),
}


def jax_body(hf: str) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    target = {
        name: jax.ShapeDtypeStruct(
            shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, PartitionSpec(*spec))
        )
        for name, (shape, dtype, spec) in JAX_LAYOUT.items()
    }
    report: dict = {}
    out = acp.load(hf, {"model": target}, report=report)["model"]
    assert all(out[n].sharding == target[n].sharding for n in target)
    return {
        "values": {n: np.asarray(a).astype(np.float32).tolist() for n, a in out.items()},
        "read": _read_phase(report),
    }


def test_hf_into_jax_2x4_mesh(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    src = {
        n: torch.randn(shape, generator=gen).to(getattr(torch, dtype))
        for n, (shape, dtype, _) in JAX_LAYOUT.items()
    }
    hf = write_hf(tmp_path / "hf", src)
    (result,) = run_jax(__file__, "jax_body", str(hf))
    for n, t in src.items():
        assert np.array_equal(np.array(result["values"][n], np.float32), t.float().numpy()), n
    read = result["read"]
    assert 0 < read["bytes"] <= MAX_OVERREAD * read["wanted_bytes"], read


# ------------------------------------------------------------------------------------------ range reads
@pytest.mark.parametrize("where", ["local", "memory"])
def test_range_reader_boxes_bit_exact_and_bounded(tmp_path: Path, where: str) -> None:
    from arraycheckpoint.planning.items import LoadShard
    from arraycheckpoint.planning.regions import Box
    from arraycheckpoint.sources.ranges import RangeReader, StoredTensor
    from arraycheckpoint.storage import storage_for

    rng = np.random.default_rng(0)
    full = rng.standard_normal((6, 40, 50)).astype(np.float32)
    blob = b"\x07" * 13 + full.tobytes() + b"\x09" * 5
    url = str(tmp_path / "files") if where == "local" else f"memory://ranges-{tmp_path.name}"
    storage, root = storage_for(url)
    if where == "local":
        Path(root).mkdir()
    storage.write(root, "data.bin", blob)
    t = StoredTensor("model/w", "data.bin", 13, full.shape, full.dtype)
    boxes = [
        Box((0, 0, 0), full.shape),
        Box((2, 0, 0), (3, 40, 50)),
        Box((1, 5, 0), (2, 30, 50)),
        Box((0, 0, 25), (6, 40, 25)),  # column halves: one run per row
        Box((3, 7, 9), (2, 11, 13)),
        Box((5, 39, 49), (1, 1, 1)),
        Box((0, 0, 0), (0, 40, 50)),
    ]
    got: dict[int, np.ndarray] = {}
    reader = RangeReader(storage, root, max_inflight_bytes=64 << 10)
    for i, b in enumerate(boxes):
        target = np.full(b.lengths, np.nan, np.float32) if i % 2 else None
        sink = lambda a, i=i: got.__setitem__(i, a.copy())  # noqa: E731
        reader.submit(t, LoadShard(b, sink, target))
        if target is not None:
            got[i] = target
    reader.finish()
    for i, b in enumerate(boxes):
        assert np.array_equal(got[i], full[b.slices()]), b
    assert reader.fetched <= MAX_OVERREAD * reader.wanted


def _raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + data)


@pytest.mark.parametrize(
    "header, data, why",
    [
        (  # two tensors on the same bytes: loaded as two aliases of one buffer
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8, "overlaps",
        ),
        (  # bytes no tensor owns (the safetensors library refuses such a file as not safetensors)
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16, "unused",
        ),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "nothing after"),
    ],
    ids=["overlap", "gap", "trailing"],
)  # fmt: skip
def test_a_safetensors_file_whose_tensors_do_not_tile_its_data_is_refused(
    tmp_path: Path, header, data, why
) -> None:
    """The HF source accepted overlapping tensors, gaps and trailing bytes, which the ``safetensors`` library
    (and so ``arraycheckpoint import``) refuses: the load and the import now answer a file alike."""
    from arraycheckpoint.errors import InconsistentCheckpointError

    _raw_safetensors(tmp_path / "model.safetensors", header, data)
    with pytest.raises(InconsistentCheckpointError, match=why) as e:
        acp.load(tmp_path, {"model": {"a": torch.zeros(2), "b": torch.zeros(2)}}, strict=False)
    assert "model.safetensors" in str(e.value)
