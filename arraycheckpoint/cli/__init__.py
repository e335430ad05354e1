"""The ``arraycheckpoint`` console command: inspect, verify, export, import, rename, diff, metrics.

Exit codes scripts can rely on:

* ``0``: success (for ``verify``: the checkpoint is intact; for ``diff``: no difference);
* ``1``: a check failed (``verify`` found a problem, ``diff`` found a difference);
* ``2``: usage or input error (bad arguments, no checkpoint at the path, unreadable source, bad map file, an
  optional dependency the command needs is not installed: the message names the extra to install);
* ``3``: an unexpected internal error (a bug: the traceback is printed).

The work itself lives in :mod:`arraycheckpoint.tools`; this module parses arguments and prints.

Layer ``cli``: may import everything but ``testing``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class UsageError(Exception):
    """Bad input detected by the command itself (exit code 2)."""


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm byte counter on stderr (shown on terminals only unless ``--progress`` forces it)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        disable=None if not enabled else False,
        file=sys.stderr,
    )


def _load_map(path: str) -> dict[str, str]:
    """The rename map of ``--map``/``--rename``: bounded like any JSON the tools read (at most 256 MiB, nested
    at most 100 levels, UTF-8); a pipe (``--map <(...)``) is fine, it is the user's own input."""
    from ..checks.bounds import MAX_METADATA_BYTES, load_json_bounded
    from ..errors import MetadataError

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_METADATA_BYTES + 1)
        mapping = load_json_bounded(raw, max_bytes=MAX_METADATA_BYTES, what=f"mapping file {path}")
    except OSError as e:
        raise UsageError(f"cannot read the mapping file {path}: {e}") from None
    except MetadataError as e:  # its wording blames a checkpoint; the map is the user's own file
        why = str(e).split("; the checkpoint is damaged")[0]
        raise UsageError(f"cannot read the mapping file {path}: {why}") from None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise UsageError(f"mapping file {path} must hold one JSON object of old name -> new name strings")
    return mapping


# ------------------------------------------------------------------------------------------- commands
def _dumps(doc: Any, indent: int | None = None) -> str:
    """``doc`` as strict JSON: an infinite or NaN number (``diff``'s ``max_abs_diff`` of NaN against a number)
    becomes the string ``"inf"``, ``"-inf"`` or ``"nan"`` (``json.dumps`` wrote ``Infinity``, which jq and
    every strict parser refuse)."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(doc), indent=indent, allow_nan=False)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..tools.common import open_checkpoint
    from ..tools.summary import format_summary, summarize

    summary = summarize(open_checkpoint(args.path))
    print(_dumps(summary, indent=2) if args.json else format_summary(summary))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ..tools.verify import verify

    total = _verify_total(args.path)
    with _progress(total, "verify", args.progress) as bar:
        report = verify(args.path, progress=bar.update, read_data=not args.no_data)
    if args.json:
        print(
            _dumps(
                {
                    "path": report.path,
                    "ok": report.ok,
                    "tensors": report.tensors,
                    "chunks": report.chunks,
                    "bytes": report.bytes,
                    "problems": [str(p) for p in report.problems],
                    "warnings": report.warnings,
                },
                indent=2,
            )
        )
    else:
        for p in report.problems:
            print(f"BAD  {p}")
        for w in report.warnings:
            print(f"WARN {w}")
        state = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
        checked = (
            "metadata, coverage and files checked (chunk data not read: --no-data)"
            if args.no_data
            else f"{report.bytes} bytes checked"
        )
        print(f"{state}: {report.path}: {report.tensors} tensors, {report.chunks} chunks, {checked}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _verify_total(path: str) -> int:
    from ..codecs import numpy_dtype
    from ..format.metadata import CheckpointMetadata
    from ..storage import storage_for

    try:
        storage, root = storage_for(path)
        raw = storage.read(root, storage.control_files(root).metadata)
        meta = CheckpointMetadata.from_json(raw) if raw else None
    except Exception:  # noqa: BLE001 - verify itself reports what is wrong
        return 0
    if meta is None:
        return 0
    total = 0
    for t in meta.tensors.values():
        n = numpy_dtype(t.dtype).itemsize
        for s in t.shape:
            n *= s
        total += n
    return total


def cmd_export(args: argparse.Namespace) -> int:
    from ..tools.common import open_checkpoint, parse_size
    from ..tools.export import export_safetensors, export_torch, hf_files, select

    try:
        cap = parse_size(args.max_shard_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ckpt = open_checkpoint(args.path)
    rename = _load_map(args.rename) if args.rename else None
    from ..tools.export import FusedSplit

    split = FusedSplit(args.num_heads, args.num_query_groups) if args.num_heads else None
    extra = hf_files(ckpt, args.config) if args.format == "safetensors" else {}
    tie = extra.get("config.json", {}).get("tie_word_embeddings") is True
    entries = select(
        ckpt, args.what, args.dtype, rename, unstack=args.unstack, split=split, tie_word_embeddings=tie
    )
    total = sum(e.nbytes for e in entries)
    with _progress(total, "export", args.progress) as bar:
        if args.format == "safetensors":
            result = export_safetensors(
                ckpt, args.out, entries, cap, progress=bar.update, overwrite=args.overwrite, extra_files=extra
            )
        else:
            result = export_torch(ckpt, args.out, entries, progress=bar.update, overwrite=args.overwrite)
    where = result.index or result.files[0]
    print(
        f"exported {result.tensors} tensors, {result.total_size} bytes, in {len(result.files)} file(s): {where}"
    )
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from ..errors import CheckpointExistsError
    from ..tools.importer import import_checkpoint

    with _progress(0, "import", args.progress) as bar:

        def total(n: int) -> None:  # known once the source is read, before any byte is copied
            bar.reset(total=n)

        try:
            result = import_checkpoint(
                args.src,
                args.path,
                namespace=args.namespace,
                strip_prefix=args.strip_prefix,
                step=args.step,
                overwrite=args.overwrite,
                progress=bar.update,
                allow_pickle=args.allow_pickle,
                on_total=total,
            )
        except CheckpointExistsError:
            from ..storage import storage_for

            backend, root = storage_for(args.path)
            if args.overwrite or not backend.is_committed(root):
                raise  # the user's files are there, or a save is in progress: said as it is
            raise UsageError(
                f"a committed checkpoint already exists at {args.path}; pass --overwrite to replace it"
            ) from None
    for s in result.skipped:
        print(f"skipped  {s}", file=sys.stderr)
    print(
        f"imported {result.tensors} tensors ({result.bytes} bytes) from {result.kind} source {args.src} "
        f"into {args.path} under {args.namespace}/"
    )
    return EXIT_OK


def cmd_rename(args: argparse.Namespace) -> int:
    from ..tools.rename import rename_checkpoint

    mapping = _load_map(args.map) if args.map else None
    result = rename_checkpoint(args.path, mapping)
    if result.resumed:
        print("finished an interrupted rename")
    for old, new in sorted({**result.tensors, **result.objects}.items()):
        print(f"{old} -> {new}")
    packs = f" ({len(result.packs)} pack file(s) rewritten)" if result.packs else ""
    print(f"renamed {len(result.tensors)} tensors and {len(result.objects)} objects in {args.path}{packs}")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    from ..tools.common import open_checkpoint
    from ..tools.diff import diff_checkpoints

    a, b = open_checkpoint(args.a), open_checkpoint(args.b)
    total = sum(t.nbytes for n, t in a.meta.tensors.items() if n in b.meta.tensors)
    with _progress(total, "diff", args.progress) as bar:
        report = diff_checkpoints(
            a,
            b,
            atol=args.atol,
            progress=bar.update,
            namespaces=args.namespace,
            objects=not args.tensors_only,
        )
    if args.json:
        print(
            _dumps(
                {
                    "same": report.same,
                    "objects": report.objects,
                    "tensors": [t.__dict__ for t in report.tensors],
                },
                indent=2,
            )
        )
    else:
        for t in report.tensors:
            if t.status == "equal" and not args.all:
                continue
            extra = f"  max_abs_diff={t.max_abs_diff:g}" if t.max_abs_diff is not None else ""
            print(f"{t.status:<9} {t.name}{extra}  {t.detail}".rstrip())
        for o in report.objects:
            print(f"object    {o}")
        n_diff = sum(t.status != "equal" for t in report.tensors) + len(report.objects)
        print(
            "identical" if report.same else f"{n_diff} difference(s)",
            f"({len(report.tensors)} tensors compared)",
        )
    return EXIT_OK if report.same else EXIT_FAILED


def cmd_metrics(args: argparse.Namespace) -> int:
    from ..tools.common import open_checkpoint, refuse_inside
    from ..tools.metrics import format_table, phase_table, plot, recorded_metrics

    ckpt = open_checkpoint(args.path)
    if args.plot:  # before anything is printed: a plot would add to or replace a file of the checkpoint
        refuse_inside(ckpt, args.plot, "read")
    if not hasattr(ckpt.storage, "control_files"):  # a foreign checkpoint opens as its load source
        kind = getattr(ckpt.storage, "kind", "foreign")
        raise UsageError(
            f"{args.path} is a {kind} checkpoint, not one arraycheckpoint saved: it records no {args.kind} metrics"
        )
    try:
        table = phase_table(recorded_metrics(ckpt.storage, ckpt.root, ckpt.meta), args.kind)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    print(_dumps(table.to_json(), indent=2) if args.json else format_table(table))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'arraycheckpoint[plot]'") from None
        out = plot(
            table,
            args.plot,
            title=f"{args.kind} of {ckpt.root}"
            + (f" (step {ckpt.meta.step})" if ckpt.meta.step is not None else ""),
        )
        print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------------------------------- parser


def _at_least_zero(convert: Callable[[str], Any], kind: str) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)``, a finite number >= 0 (``kind`` names it in the errors)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind}") from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{text!r}: it must be a finite {kind} >= 0")
        return value

    return parse


_non_negative_int = _at_least_zero(int, "whole number")  # a training step
_tolerance = _at_least_zero(float, "number")  # an absolute tolerance


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command (one sub-parser per subcommand, each with ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="arraycheckpoint",
        description="Inspect, verify, convert and compare arraycheckpoint checkpoints.",
        epilog="exit codes: 0 ok, 1 check failed / differences found, 2 usage or input error, 3 internal error",
    )
    from ..format.version import __version__

    parser.add_argument("--version", action="version", version=f"arraycheckpoint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=fn)
        return p

    def progress_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--progress", action="store_true", help="show progress bars even when stderr is not a terminal"
        )

    p = add(
        "inspect", cmd_inspect, "list tensors, shapes, dtypes, sizes, save-time sharding, topology and step"
    )
    p.add_argument("path", help="checkpoint path or URL")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")

    p = add(
        "verify",
        cmd_verify,
        "check the commit marker, region coverage and every chunk's checksums "
        "(exit 1 when anything is wrong)",
    )
    p.add_argument("path", help="checkpoint path or URL")
    p.add_argument(
        "--no-data", action="store_true", help="skip reading chunks (metadata, coverage, files only)"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    progress_flag(p)

    p = add(
        "export", cmd_export, "merge a checkpoint (any save layout) into HF-style safetensors or a torch file"
    )
    p.add_argument("path", help="checkpoint path or URL")
    p.add_argument("out", help="output directory (safetensors) or file (torch)")
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="safetensors: HF-style sharded files with an index (default); torch: one torch.save file",
    )
    p.add_argument(
        "--what",
        choices=("model", "all"),
        default="model",
        help="model tensors only (default) or every tensor, optimizer state included",
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="cap per safetensors file, e.g. 5GB, 500MB (default 5GB)"
    )
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16, float16, float32")
    p.add_argument(
        "--rename",
        metavar="FILE",
        help="JSON object mapping exported key -> new key; keys may be {i} patterns or re:<regex> (\\1 in the value)",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="Hugging Face config.json, or a directory with config.json [and generation_config.json], to write "
        "beside the weights (default: the config arraycheckpoint.save stored for a transformers model)",
    )
    p.add_argument(
        "--unstack", action="store_true", help="megatron: write stacked [L, ...] layers as layers.{i}.* keys"
    )
    p.add_argument("--num-heads", type=int, help="with --unstack: split linear_qkv (and gated linear_fc1)")
    p.add_argument("--num-query-groups", type=int, help="with --num-heads: GQA query groups (default: heads)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace safetensors files / the torch file in OUT"
    )
    progress_flag(p)

    p = add(
        "import", cmd_import, "import a safetensors file / HF directory, torch.save file or DCP directory"
    )
    p.add_argument(
        "src",
        help="*.safetensors, a directory with model.safetensors.index.json, a DCP directory "
        "or a torch.save file",
    )
    p.add_argument("path", help="new checkpoint path or URL")
    p.add_argument("--namespace", default="model", help="namespace of the imported tensors (default: model)")
    p.add_argument("--strip-prefix", help="remove this prefix from source keys (e.g. 'module.')")
    p.add_argument("--step", type=_non_negative_int, help="training step to record")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at PATH")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="needed for a DCP source: its .metadata is a pickle, which runs code when read (trusted sources only)",
    )
    progress_flag(p)

    p = add(
        "rename",
        cmd_rename,
        "rename keys in place (directory renames or pack rewrites + metadata rewrite, local paths only)",
    )
    p.add_argument("path", help="local checkpoint path")
    p.add_argument(
        "--map",
        metavar="FILE",
        help="JSON object old -> new; a key without '/' is a parameter FQN "
        "renamed in every namespace (model, optimizer)",
    )

    p = add("diff", cmd_diff, "compare two checkpoints tensor by tensor (exit 1 when they differ)")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--atol", type=_tolerance, default=0.0, help="treat max abs differences <= ATOL as equal")
    p.add_argument("--all", action="store_true", help="also list equal tensors")
    p.add_argument(
        "--tensors-only", action="store_true", help="ignore JSON objects (param groups, extra state)"
    )
    p.add_argument(
        "--namespace",
        action="append",
        help="compare only this top-level namespace (model, optimizer, ...); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    progress_flag(p)

    p = add("metrics", cmd_metrics, "per-rank phase timings of the save (or a recorded load): table, plots")
    p.add_argument("path", help="checkpoint path or URL")
    p.add_argument(
        "--kind",
        choices=("save", "load"),
        default="save",
        help="save (default), or load: the last acp.load(..., record_metrics=True)",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="draw the heat-map and timeline into this PNG (or .svg, .pdf, ...), outside the checkpoint",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


#: top-level module -> the extra of this package that installs it
_EXTRAS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "megatron": "megatron", "matplotlib": "plot"}


def missing_dependency(error: ModuleNotFoundError) -> str:
    """The message for a missing optional dependency: what is missing and the command that installs it."""
    module = (error.name or str(error)).split(".")[0]
    extra = _EXTRAS.get(module)
    fix = f"pip install 'arraycheckpoint[{extra}]'" if extra else f"pip install {module}"
    return f"this needs {module!r}, which is not installed: {fix}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (see the module docstring)."""
    from ..errors import ArrayCheckpointError, PickleNotAllowedError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (
        UsageError,
        ArrayCheckpointError,
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
    ) as e:
        hint = ""
        if isinstance(e, PickleNotAllowedError) and args.command != "import":
            hint = (
                "; the command line reads a DCP directory only through `arraycheckpoint import SRC PATH "
                "--allow-pickle`, which makes a checkpoint of it"
            )
        print(f"arraycheckpoint {args.command}: error: {e}{hint}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:  # an optional dependency this command needs: say which extra installs it
        print(f"arraycheckpoint {args.command}: error: {missing_dependency(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `arraycheckpoint inspect ... | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - a bug: show it, with its own exit code
        import traceback

        traceback.print_exc()
        print(f"arraycheckpoint {args.command}: internal error (please report)", file=sys.stderr)
        return EXIT_INTERNAL
