"""A user backend (``register_scheme``) overriding ``Storage.read`` with the two-argument signature documented
before, ``read(root, key)``, still loads DCP and safetensors checkpoints.

Before (review23c D4): the DCP and safetensors sources called ``storage.read(root, key, limit)``, and such a
backend raised ``TypeError: read() takes 3 positional arguments but 4 were given``. Now a backend whose
override takes no ``limit`` is called as it was written (the source checks the size itself).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.storage import register_scheme, storage_for
from arraycheckpoint.storage.local import LocalStorage
from arraycheckpoint.storage.memory import MemoryStorage


class AuditedLocal(LocalStorage):
    reads: list[str] = []

    def read(self, root: str, key: str) -> bytes | None:  # type: ignore[override]
        AuditedLocal.reads.append(key)
        return super().read(root, key)

    def normalize(self, url: str) -> str:
        return super().normalize(url.replace("auditedlocal://", "", 1))


class AuditedMemory(MemoryStorage):
    reads: list[str] = []

    def read(self, root: str, key: str) -> bytes | None:  # type: ignore[override]
        AuditedMemory.reads.append(key)
        return super().read(root, key)

    def normalize(self, url: str) -> str:
        return super().normalize(url.replace("auditedmem://", "memory://", 1))


def test_a_dcp_checkpoint_loads_through_a_two_argument_read(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    register_scheme("auditedlocal", AuditedLocal)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    back = {"w": torch.zeros(4)}
    acp.load(f"auditedlocal://{tmp_path}", back, allow_pickle=True)  # before: TypeError
    assert torch.equal(back["w"], torch.arange(4.0))
    assert ".metadata" in AuditedLocal.reads


def test_a_safetensors_file_loads_through_a_two_argument_read(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    register_scheme("auditedmem", AuditedMemory)
    save_file({"w": torch.arange(6.0)}, str(tmp_path / "part-1.safetensors"))
    url = f"auditedmem://st-{uuid.uuid4().hex[:8]}/model"
    storage, root = storage_for(url)
    storage.write(root, "part-1.safetensors", (tmp_path / "part-1.safetensors").read_bytes())
    index = {"metadata": {}, "weight_map": {"w": "part-1.safetensors"}}  # a sharded model: its index is read
    storage.write(root, "model.safetensors.index.json", json.dumps(index).encode())
    back = {"model": {"w": torch.zeros(6)}}
    acp.load(url, back)  # before: TypeError
    assert torch.equal(back["model"]["w"], torch.arange(6.0))
    assert "model.safetensors.index.json" in AuditedMemory.reads
