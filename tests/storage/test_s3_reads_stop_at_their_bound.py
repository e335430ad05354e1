"""A document read from S3 (a checkpoint's metadata, an HF directory's ``config.json`` or index) is fetched only up
to its bound, however large the object is.

Before: ``Storage.read`` went through tensorstore, which downloads the whole object; its size was checked after
(the metadata's 256 MiB by the JSON parser, a 16 MiB ``config.json`` by the source), so a hostile object of any
size was downloaded and held in memory whole (40 MiB here, for a file bounded at 16 MiB). Local and fsspec reads already
stopped at the bound. Now S3 reads ask botocore for the first ``limit + 1`` bytes and read no more.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.storage import configure

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_an_hf_config_json_larger_than_its_bound_is_refused_without_downloading_it(
    s3_server, s3_prefix: str, fault_proxy
) -> None:
    prefix = s3_prefix[len(f"s3://{s3_server.bucket}/") :] + "/hf/"
    weights = {"embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    s3_server.client.put_object(
        Bucket=s3_server.bucket, Key=prefix + "model.safetensors", Body=safetensors_torch.save(weights)
    )
    config = json.dumps({"tie_word_embeddings": True, "pad": "x" * (40 << 20)}).encode()  # bound: 16 MiB
    s3_server.client.upload_fileobj(io.BytesIO(config), s3_server.bucket, prefix + "config.json")
    del config

    target = {"model": {"embed_tokens.weight": torch.zeros(3, 4)}}
    configure("s3", endpoint=fault_proxy.endpoint)  # every request and the bytes it moved, logged
    try:
        with pytest.raises(MetadataError, match="config.json"):
            acp.load(f"{s3_prefix}/hf", target)
    finally:
        configure("s3", endpoint=None)
    gets = [moved for method, path, _range, moved in fault_proxy.requests if path.endswith("/config.json")]
    assert gets and max(gets) <= (16 << 20) + 1, gets  # before: one GET of all 40 MiB


def test_a_small_document_reads_whole_and_an_empty_one_as_empty(s3_server, s3_prefix: str) -> None:
    from arraycheckpoint.storage import storage_for

    backend, root = storage_for(s3_prefix + "/docs")
    prefix = root[len(f"s3://{s3_server.bucket}/") :] + "/"
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=prefix + "a.json", Body=b"[1, 2, 3]")
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=prefix + "empty", Body=b"")
    assert backend.read(root, "a.json") == b"[1, 2, 3]"
    assert backend.read(root, "a.json", 9) == b"[1, 2, 3]"
    with pytest.raises(MetadataError, match="a.json is larger than 8 bytes"):
        backend.read(root, "a.json", 8)
    assert backend.read(root, "empty") == b""
    assert backend.read(root, "absent") is None
