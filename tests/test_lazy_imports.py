"""A load imports only the framework modules its state uses (the first load of a fresh process paid 6 s for
``torch.distributed.fsdp`` and sympy, which a plain module never needs)."""

from __future__ import annotations

import subprocess
import sys

import torch

import arraycheckpoint as acp

_LOADER = r"""
import sys
import torch
import arraycheckpoint as acp

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
for p in model.parameters():
    torch.nn.init.zeros_(p)
acp.load(sys.argv[1], {"model": model})
assert torch.equal(model[0].weight, torch.load(sys.argv[2])), "not loaded bit-exactly"
acp.save(sys.argv[1] + "-again", {"model": model})  # a save of a plain module imports nothing more either
heavy = [m for m in ("torch.distributed.fsdp", "torch.distributed.tensor", "sympy") if m in sys.modules]
assert not heavy, f"a plain module's load imported {heavy}"
print("ok")
"""


def test_plain_module_load_imports_no_fsdp_nor_sympy(tmp_path):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    acp.save(tmp_path / "ck", {"model": model})
    torch.save(model[0].weight.detach().clone(), tmp_path / "w.pt")
    res = subprocess.run(
        [sys.executable, "-c", _LOADER, str(tmp_path / "ck"), str(tmp_path / "w.pt")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
