"""Hostile-checkpoint cases written against the Storage API only, so that each runs on every backend.

Each case saves a small checkpoint at ``url``, tampers with it the way an attacker (or damage) would, loads
it and returns what happened: ``"RAISED <type> <message>"`` or ``"LOADED <equal|different>"``. The suite
(test_backends.py) runs every case in its own process, so a case that used to abort cannot kill pytest.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import arraycheckpoint as acp
from arraycheckpoint.codecs import array_metadata
from arraycheckpoint.format.metadata import METADATA_FILE
from arraycheckpoint.storage import storage_for

#: The directory layout: these cases damage an array's own files; packed arrays (format 5) have their own
#: hostile cases (tests/faults/test_hostile_packs.py)
UNPACKED = acp.PlanOptions(pack_array_bytes=0)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 32)


def _edit_json(url: str, key: str, fn: Callable[[Any], None], sub: str = "") -> None:
    st, root = storage_for(url)
    where = st.join(root, sub) if sub else root
    doc = json.loads(st.read(where, key))
    fn(doc)
    st.write(where, key, json.dumps(doc).encode())


def _chunk_keys(url: str, name: str) -> list[str]:
    st, root = storage_for(url)
    return [k for k in st.list(st.join(root, name)) if k.startswith("c")]


def _replace_array(url: str, name: str, meta: dict[str, Any], data: np.ndarray) -> None:
    """Write ``data`` as array ``name`` with zarr metadata ``meta`` (built in memory, copied object by object)."""
    import tensorstore as ts

    st, root = storage_for(url)
    area = f"forge-{np.random.randint(1 << 30)}/"
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "memory", "path": area},
        "metadata": meta,
        "store_data_equal_to_fill_value": True,
    }
    ctx = ts.Context()  # one memory kvstore for the forged array and its listing
    arr = ts.open(spec, create=True, context=ctx).result()
    arr.write(data).result()
    kv = ts.KvStore.open({"driver": "memory", "path": area}, context=ctx).result()
    array_root = st.join(root, name)
    for key in st.list(array_root):
        st.delete_key(array_root, key)
    for key in kv.list().result():
        k = key.decode()
        st.write(array_root, k, bytes(kv.read(k).result().value))


def _load(url: str, extra: bool = False) -> tuple[str, torch.nn.Module]:
    target = _model(99)
    state: dict[str, Any] = {"model": target}
    if extra:
        state["extra_state"] = {}
    try:
        acp.load(url, state)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"RAISED {type(e).__name__} {str(e)[:3000]}", target
    return "LOADED", target


def chunk_larger_than_shape(url: str) -> str:
    acp.save(url, {"model": _model(1)}, plan_options=UNPACKED)
    _edit_json(
        url,
        METADATA_FILE,
        lambda d: d["tensors"]["model/bias"].update(chunk_shape=[2**45], inner_chunk_shape=[2**45]),
    )
    return _load(url)[0]


def zarr_json_shape_1e13(url: str) -> str:
    acp.save(url, {"model": _model(1)}, plan_options=UNPACKED)
    _edit_json(url, METADATA_FILE, lambda d: d.update(codec_preset=0))

    def huge(doc: dict[str, Any]) -> None:
        doc["shape"] = [10**13]
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [10**13]
        doc["codecs"][0]["configuration"]["chunk_shape"] = [10**13]

    _edit_json(url, "zarr.json", huge, sub="model/bias")
    return _load(url)[0]


def extra_state_1e13(url: str) -> str:
    acp.save(
        url,
        {"model": _model(1), "extra_state": {"buf": np.arange(32, dtype=np.int64)}},
        plan_options=UNPACKED,
    )
    st, root = storage_for(url)
    name = next(n for n in json.loads(st.read(root, METADATA_FILE))["tensors"] if "extra" in n)

    def huge(doc: dict[str, Any]) -> None:
        doc["tensors"][name]["shape"] = [10**13]
        doc["tensors"][name]["shards"] = [[[0], [10**13], 0]]

    _edit_json(url, METADATA_FILE, huge)
    return _load(url, extra=True)[0] + f" [{name}]"


def crc32c_off(url: str) -> str:
    model = _model(1)
    acp.save(url, {"model": model}, plan_options=UNPACKED)
    _edit_json(url, METADATA_FILE, lambda d: d.update(codec_preset=0))
    tm = acp.read_metadata(url).tensors["model/weight"]
    meta = array_metadata(tm.shape, np.float32, tm.chunk_shape, tm.inner_chunk_shape)
    cfg = meta["codecs"][0]["configuration"]
    cfg["codecs"] = [c for c in cfg["codecs"] if c["name"] != "crc32c"]
    cfg["index_codecs"] = [c for c in cfg["index_codecs"] if c["name"] != "crc32c"]
    forged = model.weight.detach().numpy().copy()
    forged[0, 0] += 1.0
    _replace_array(url, "model/weight", meta, forged)
    out, target = _load(url)
    if out == "LOADED":
        out += " different" if not torch.equal(target.weight, model.weight) else " equal"
    return out


def zstd_bomb(url: str) -> str:
    import tensorstore as ts

    acp.save(url, {"model": _model(1)}, compression="zstd", plan_options=UNPACKED)
    n = (64 << 20) // 4
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "memory", "path": "bomb/"},
        "metadata": array_metadata((n,), np.float32, (n,), (n,), "zstd", compression_level=19),
        "store_data_equal_to_fill_value": True,
    }
    ctx = ts.Context()
    ts.open(spec, create=True, context=ctx).result().write(np.zeros(n, np.float32)).result()
    kv = ts.KvStore.open({"driver": "memory", "path": "bomb/"}, context=ctx).result()
    bomb = bytes(kv.read("c.0").result().value)
    st, root = storage_for(url)
    st.write(st.join(root, "model/weight"), _chunk_keys(url, "model/weight")[0], bomb)
    return _load(url)[0]


def oversized_chunk(url: str) -> str:
    """A compressed chunk file far larger than any encoding of its chunk: refused before it is read whole,
    also where the storage lists no sizes (memory, S3)."""
    acp.save(url, {"model": _model(1)}, compression="zstd", plan_options=UNPACKED)
    st, root = storage_for(url)
    st.write(st.join(root, "model/weight"), _chunk_keys(url, "model/weight")[0], b"\0" * (16 << 20))
    return _load(url)[0]


def deep_json(url: str) -> str:
    acp.save(url, {"model": _model(1), "extra_state": {"step": 1}}, plan_options=UNPACKED)
    st, root = storage_for(url)
    raw = st.read(root, METADATA_FILE).decode()
    raw = raw.replace('"step":1', '"step":' + "[" * 5000 + "]" * 5000, 1)
    st.write(root, METADATA_FILE, raw.encode())
    return _load(url, extra=True)[0]


def flipped_byte(url: str) -> str:
    acp.save(url, {"model": _model(1)}, plan_options=UNPACKED)
    st, root = storage_for(url)
    array_root = st.join(root, "model/weight")
    key = _chunk_keys(url, "model/weight")[0]
    data = bytearray(st.read(array_root, key))
    data[len(data) // 3] ^= 0x20
    st.write(array_root, key, bytes(data))
    return _load(url)[0]


def missing_chunk(url: str) -> str:
    acp.save(url, {"model": _model(1)}, plan_options=UNPACKED)
    st, root = storage_for(url)
    st.delete_key(st.join(root, "model/weight"), _chunk_keys(url, "model/weight")[0])
    return _load(url)[0]


def round_trip(url: str) -> str:
    model = _model(1)
    acp.save(url, {"model": model}, plan_options=UNPACKED)
    out, target = _load(url)
    return out + (" equal" if torch.equal(target.weight, model.weight) else " different")


CASES = {
    f.__name__: f
    for f in (
        chunk_larger_than_shape,
        zarr_json_shape_1e13,
        extra_state_1e13,
        crc32c_off,
        zstd_bomb,
        oversized_chunk,
        deep_json,
        flipped_byte,
        missing_chunk,
        round_trip,
    )
}


def main(name: str, url: str) -> None:
    print("RESULT", CASES[name](url))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
