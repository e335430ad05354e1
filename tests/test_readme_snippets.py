"""Every Python snippet of README.md runs as written (extracted from the README, so the two cannot drift); so
does every annotated snippet of docs/*.md (a docs snippet without an annotation is not run).

A snippet is annotated by the line before its fence: ``<!-- snippet: NAME -->`` runs it after the setup
``NAME`` below (which defines what the surrounding text says the reader has: a model, a checkpoint path),
in a fresh working directory; ``<!-- snippet: skip: REASON -->`` names what a test here cannot have (GPUs,
a download, a multi-rank launcher) and where the suite covers it instead. A snippet without an annotation
fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
_SNIPPET = re.compile(
    r"^([ \t]*)<!-- snippet: (?P<tag>[^\n]*?) -->\n\1```python\n(?P<code>.*?)^\1```", re.M | re.S
)
_FENCE = re.compile(r"^[ \t]*```python$", re.M)


def _annotated(path: Path) -> list[tuple[str, str]]:
    """``(tag, code)`` of every annotated snippet of ``path``, in file order (code dedented)."""
    text = path.read_text()
    return [(m.group("tag"), textwrap.dedent(m.group("code"))) for m in _SNIPPET.finditer(text)]


def snippets() -> list[tuple[str, str]]:
    """``(tag, code)`` of every snippet of README.md (each must be annotated), in README order."""
    found = _annotated(REPO / "README.md")
    assert len(found) == len(_FENCE.findall((REPO / "README.md").read_text())), (
        "a ```python snippet of README.md has no '<!-- snippet: NAME -->' or '<!-- snippet: skip: REASON -->' "
        "line before it"
    )
    return found


# setups: what the README's text says the reader already has --------------------------------------------------
def _key_map() -> dict[str, Any]:
    import torch

    import arraycheckpoint as acp

    def net(first: str, second: str) -> torch.nn.Module:
        m = torch.nn.Module()
        setattr(m, first, torch.nn.Module())
        getattr(m, first).proj = torch.nn.Linear(4, 4, bias=False)
        setattr(m, second, torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False)]))
        return m

    torch.manual_seed(0)
    saved = net("enc", "layers")
    acp.save("ckpt/renamed", {"model": saved, "optimizer": torch.optim.SGD(saved.parameters(), lr=0.1)})
    model = net("encoder", "layers")
    return {
        "acp": acp,
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.5),
        "path": "ckpt/renamed",
        "state": {"model": net("enc", "blocks")},
        "_check": lambda ns: (
            torch.equal(model.encoder.proj.weight, saved.enc.proj.weight)
            and torch.equal(ns["state"]["model"].blocks[0].weight, saved.layers[0].weight)
            and ns["opt"].param_groups[0]["lr"] == 0.1
        ),
    }


def _model_opt() -> dict[str, Any]:
    import torch

    import arraycheckpoint as acp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "extra_state": {"step": 7}}
    return {"acp": acp, "model": model, "opt": opt, "step": 7, "state": state, "path": "ckpt/t"}


def _ckpt_step_100() -> dict[str, Any]:
    import torch

    import arraycheckpoint as acp

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].w = torch.nn.Parameter(
        torch.randn(64, 64)
    )  # 16 KiB: its own file (above the 8 KiB target)
    model.layers[0].norm = torch.nn.LayerNorm(64)  # 256 bytes: packed (format 6: below the target file size)
    acp.save("ckpt/step_100", {"model": model}, plan_options=acp.PlanOptions(min_chunk_bytes=8 << 10))
    return {"acp": acp, "arraycheckpoint": sys.modules["arraycheckpoint"]}


SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    "use": dict,
    "accelerate": dict,  # self-contained: accelerate's prepared model and optimizer, saved and loaded
    "key_map": _key_map,
    "manager": _model_opt,
    "timeout": _model_opt,
    "dcp": _model_opt,
    "ckpt_step_100": _ckpt_step_100,
}

_JAX_SETUP = """
import jax, numpy as np, torch
from jax.sharding import NamedSharding, PartitionSpec as P
import arraycheckpoint as acp
params = {"w": jax.numpy.arange(32.0).reshape(4, 8), "b": jax.numpy.arange(8.0)}
acp.save("ckpt/torch", {"model": torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 8)})})
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
flax_target = {"dense": {"kernel": jax.ShapeDtypeStruct((4, 8), jax.numpy.bfloat16, sharding=one)}}
"""


def _cases() -> list[Any]:
    sources = [("README", snippets())]
    sources += [(f"docs-{p.stem}", _annotated(p)) for p in sorted((REPO / "docs").glob("*.md"))]
    out = []
    for where, found in sources:
        for i, (tag, code) in enumerate(found):
            marks = [pytest.mark.skip(reason=tag[len("skip:") :].strip())] if tag.startswith("skip:") else []
            out.append(pytest.param(tag, code, id=f"{where}-{i}-{tag.split(':')[0]}", marks=marks))
    return out


@pytest.mark.parametrize(("tag", "code"), _cases())
def test_readme_snippet(tag: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if tag == "jax":  # jax fixes its device count at import: a fresh interpreter with 8 CPU devices
        env = {
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        proc = subprocess.run(
            [sys.executable, "-c", _JAX_SETUP + code], capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return
    assert tag in SETUPS, f"snippet tagged {tag!r}: no such setup in {__file__}"
    namespace = SETUPS[tag]()
    check = namespace.pop("_check", None)
    exec(compile(code, f"snippet {tag}", "exec"), namespace)  # noqa: S102 - the README's own code
    if check is not None:
        assert check(namespace)
