"""Loading a Hugging Face safetensors directory: ``acp.load(hf_dir, ...)`` against DCP's own
``HuggingFaceStorageReader`` (``dcp.load(model.state_dict(), storage_reader=...)``) on the same files.

The model is a stack of bias-free ``Linear(hidden, hidden)`` layers (float32, ``--params-m`` million
parameters), written once with ``safetensors`` as an index and two shard files. At each world size in
``--worlds`` (gloo ranks; 1 = a plain module, more = FSDP2 over a CPU DeviceMesh, each layer and the root
wrapped with ``fully_shard``), every round loads the directory with both methods, alternating which goes
first; the slowest rank's time after a barrier is recorded and the median over ``--repeats`` rounds (after
one warm-up round) is reported. The page cache is left warm for both. After the first round both methods'
local tensors are compared bit-exactly with each other and with the file. ``acp bytes/own`` is the bytes
each rank fetched from storage over the bytes of its own regions (worst rank). Run::

    python benchmarks/bench_hf.py                     # 64M params (256 MiB), worlds 1 and 4
    python benchmarks/bench_hf.py --params-m 8        # quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fsdp import _timed, spawn  # noqa: E402
from common import MiB, fmt_ratio, fmt_seconds, machine_description, markdown_table, median, ratio  # noqa: E402

HIDDEN = 2048


def write_hf(root: Path, layers: int) -> Path:
    """The Hugging Face directory: index + two shard files of ``{i}.weight`` tensors."""
    from safetensors.torch import save_file

    hf = root / "hf"
    hf.mkdir()
    gen = torch.Generator().manual_seed(0)
    keys = [f"{i}.weight" for i in range(layers)]
    weight_map = {}
    for part, names in enumerate((keys[: layers // 2], keys[layers // 2 :])):
        fname = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({k: torch.randn(HIDDEN, HIDDEN, generator=gen) for k in names}, str(hf / fname))
        weight_map.update(dict.fromkeys(names, fname))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf


def build(world: int, layers: int) -> torch.nn.Module:
    """Uninitialised parameters (the loads fill them): a plain module, or FSDP2 when ``world > 1``."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)])
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model.to_empty(device="cpu")


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def bench(rank: int, world: int, hf: str, layers: int, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    import arraycheckpoint as acp

    model = build(world, layers)
    reads: list[float] = []

    def acp_load() -> None:
        report: dict = {}
        acp.load(hf, {"model": model}, report=report)
        (read,) = [p for p in report["metrics"] if p["phase"] == "read"]
        reads.append(read["bytes"] / read["wanted_bytes"])

    def dcp_load() -> None:
        dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(hf))

    times: dict[str, list[float]] = {"acp": [], "dcp": []}
    for r in range(repeats + 1):
        order = [("acp", acp_load), ("dcp", dcp_load)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            for t in _local(model):
                t.detach().fill_(float("nan"))
            seconds, _ = _timed(fn)
            if r:
                times[name].append(seconds)
            if r == 0:
                got = [t.detach().clone() for t in _local(model)]
                if name == "acp":
                    first = got
                else:
                    assert all(torch.equal(a, b) for a, b in zip(first, got)), "acp and DCP loads differ"
    # against the file: this rank's first row of every local shard
    index = json.loads((Path(hf) / "model.safetensors.index.json").read_text())["weight_map"]
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(model.parameters()):
        if isinstance(p, DTensor):
            offset = p.to_local().shape[0] and (p.device_mesh.get_local_rank() * -(-HIDDEN // world))
        else:
            offset = 0
        local = _local(model)[i]
        if local.shape[0]:
            with safe_open(str(Path(hf) / index[f"{i}.weight"]), "pt") as f:
                row = f.get_slice(f"{i}.weight")[offset : offset + 1]
            assert torch.equal(local[:1], row), f"layer {i} differs from the file"
    return {"acp": median(times["acp"]), "dcp": median(times["dcp"]), "read_ratio": max(reads)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=64.0, help="million float32 parameters (default 64)")
    ap.add_argument("--worlds", default="1,4", help="comma-separated world sizes (default 1,4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    ap.add_argument("--dir", help="scratch directory (default: a temporary directory)")
    args = ap.parse_args(argv)
    layers = max(2, round(args.params_m * 1e6 / HIDDEN**2))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        hf = write_hf(Path(tmp), layers)
        size = sum(f.stat().st_size for f in hf.iterdir())
        print(
            f"wrote {layers} x [{HIDDEN}, {HIDDEN}] float32 ({size / MiB:.0f} MiB) in {time.perf_counter() - t0:.1f}s"
        )
        rows = []
        for world in (int(w) for w in args.worlds.split(",")):
            out = spawn(bench, world, (str(hf), layers, args.repeats))
            a, d = max(r["acp"] for r in out), max(r["dcp"] for r in out)
            rows.append(
                [
                    str(world),
                    fmt_seconds(a),
                    fmt_seconds(d),
                    fmt_ratio(ratio(a, d)),
                    f"{max(r['read_ratio'] for r in out):.3f}",
                ]
            )
        print(machine_description(tmp))
        print(
            markdown_table(
                [
                    "ranks",
                    "acp.load(hf_dir)",
                    "dcp.load + HuggingFaceStorageReader",
                    "acp / dcp",
                    "acp bytes/own",
                ],
                rows,
            )
        )


if __name__ == "__main__":
    main()
