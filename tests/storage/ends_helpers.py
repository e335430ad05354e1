"""Shared by the tests of packs' ends read ahead on object stores (``test_pack_ends_ahead.py``,
``test_store_ends_ahead.py``): 4 simulated ranks of 16 small packs each, uploaded to the loopback S3 server,
read through the counting proxy (``proxied`` in ``conftest.py``)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np

import arraycheckpoint as acp

RANKS, PACKS = 4, 16  # packs per rank: one tensor of 1 KiB each


def state() -> dict[str, Any]:
    """What every rank saves: 64 tensors of 1 KiB."""
    rng = np.random.default_rng(11)
    return {"model": {f"t{i:02d}": rng.standard_normal(256).astype(np.float32) for i in range(RANKS * PACKS)}}


def save_packs(path: Path) -> Path:
    """:func:`state` saved at ``path`` by 4 simulated ranks, a pack per tensor."""
    from simworld import run_ranks

    options = acp.PlanOptions(min_chunk_bytes=2048)  # a pack per tensor
    run_ranks(RANKS, lambda c: acp.save(path, state(), comm=c, plan_options=options))
    assert len(list((path / ".acp" / "packs").iterdir())) == RANKS * PACKS
    return path


def upload(
    s3_server: Any,
    local: Path,
    damage: str | None = None,
    untargeted: bool = False,
    prefix: str | None = None,
) -> str:
    """The checkpoint ``local`` under ``prefix`` (a fresh one when None); ``damage``: a pack whose end record is
    cut; ``untargeted``: its metadata records no fill target (``.acp/packs/<rank>``, as the first format-6
    code wrote it)."""
    prefix = prefix or f"ends-{uuid.uuid4().hex[:8]}"
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        rel = path.relative_to(local).as_posix()
        body = path.read_bytes()
        if rel == damage:
            body = body[:-30]
        if untargeted and rel == ".acp/metadata.json":
            doc = json.loads(body)
            for t in doc["tensors"].values():
                if t.get("pack"):
                    t["pack"] = t["pack"].partition("@")[0]
            body = json.dumps(doc).encode()
        s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{rel}", Body=body)
    return prefix
