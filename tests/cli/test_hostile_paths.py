"""Paths the tools are handed: ``export`` never writes through a link planted in its output, never into the
checkpoint it reads, and a failed export leaves no partial set of files; ``import`` never opens a source that
could block it. Run in process, on tiny checkpoints."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from cli_helpers import flip_chunk_byte, run_main

import arraycheckpoint as acp
from arraycheckpoint.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE

_run = run_main


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    path = tmp_path / "ck"
    acp.save(path, {"model": model}, step=3)
    return path


def _tree(path) -> dict[str, bytes | str]:
    """Every entry below ``path``: a file's bytes, a link's target."""
    out: dict[str, bytes | str] = {}
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, path)
            if os.path.islink(p):
                out[rel] = os.readlink(p)
            elif os.path.isfile(p):
                out[rel] = open(p, "rb").read()
    return out


@pytest.mark.parametrize("overwrite", [False, True])
def test_export_writes_nothing_through_dangling_links_in_its_output(ckpt, tmp_path, capsys, overwrite):
    """A dangling link named like the index (or ``config.json``) was not seen as an existing output
    (``os.path.exists`` follows it) and the index was then written through it, creating a file outside
    the output directory."""
    out = tmp_path / "hf"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside / "index", out / "model.safetensors.index.json")
    os.symlink(outside / "tmp", out / ".model-00001-of-00001.safetensors.tmp")
    code, _, err = _run(capsys, "export", ckpt, out, *(["--overwrite"] if overwrite else []))
    assert os.listdir(outside) == [], "written through a link"
    if not overwrite:
        assert code == EXIT_USAGE and "model.safetensors.index.json" in err and "--overwrite" in err
        return
    assert code == EXIT_OK
    assert not os.path.islink(out / "model.safetensors.index.json")
    assert (out / "model-00001-of-00001.safetensors").is_file()
    assert sorted(os.listdir(out)) == [
        ".model-00001-of-00001.safetensors.tmp",  # not ours: left as it was
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_torch_export_writes_nothing_through_a_link_planted_as_its_temporary_file(ckpt, tmp_path, capsys):
    """``export --format torch OUT`` wrote ``OUT.tmp`` with ``torch.save`` (following a link planted there)
    and renamed the link onto ``OUT``: the state went to the link's target and ``OUT`` became the link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "model.pt"
    os.symlink(outside / "victim.pt", str(out) + ".tmp")
    code, _, err = _run(capsys, "export", ckpt, out, "--format", "torch")
    assert code == EXIT_OK, err
    assert os.listdir(outside) == []
    assert out.is_file() and not out.is_symlink()
    assert set(torch.load(out, weights_only=True)) == {"0.weight", "0.bias", "1.weight", "1.bias"}


@pytest.mark.parametrize("where", [".", "hf", "model/hf"])
def test_export_into_the_checkpoint_it_reads_is_refused(ckpt, capsys, where):
    """Exporting into the checkpoint (its root or a directory below it) put safetensors files inside a
    committed checkpoint, which a later ``save(..., overwrite=True)`` deletes with it."""
    before = _tree(ckpt)
    code, _, err = _run(capsys, "export", ckpt, ckpt / where)
    assert code == EXIT_USAGE and "inside the checkpoint" in err and str(ckpt) in err
    assert _tree(ckpt) == before
    code, _, err = _run(capsys, "export", ckpt, ckpt / where / "m.pt", "--format", "torch")
    assert code == EXIT_USAGE and "inside the checkpoint" in err
    assert _tree(ckpt) == before


def test_export_into_a_link_to_the_checkpoint_is_refused(ckpt, tmp_path, capsys):
    os.symlink(ckpt, tmp_path / "alias")
    before = _tree(ckpt)
    code, _, err = _run(capsys, "export", ckpt, tmp_path / "alias" / "hf")
    assert code == EXIT_USAGE and "inside the checkpoint" in err
    assert _tree(ckpt) == before


def test_a_failed_export_leaves_none_of_its_files(ckpt, tmp_path, capsys):
    """A damaged tensor in the second output file failed the export after the first file was written:
    that file stayed without an index, and a rerun was refused as an existing export."""
    flip_chunk_byte(str(ckpt), "model/1.weight", "c.0.0", 5)  # files in name order: 0.*, then 1.*
    out = tmp_path / "hf"
    code, _, err = _run(capsys, "export", ckpt, out, "--max-shard-size", "300")
    assert code in (EXIT_USAGE, EXIT_FAILED) and "1.weight" in err
    assert os.listdir(out) == []


@pytest.mark.parametrize("name", ["weights.pt", "model.safetensors"])
def test_import_of_a_fifo_is_refused_at_once(tmp_path, capsys, name):
    """``arraycheckpoint import FIFO OUT`` (any name but ``*.safetensors``) blocked forever in
    ``torch.load`` opening the FIFO; only regular files are read."""
    fifo = tmp_path / name
    os.mkfifo(fifo)
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(r=_run(capsys, "import", fifo, tmp_path / "out")), daemon=True
    )
    t.start()
    t.join(60)
    if t.is_alive():
        with open(fifo, "wb"):  # unblock the reader before failing
            pass
        pytest.fail("import blocked on a FIFO")
    code, _, err = box["r"]
    assert code == EXIT_USAGE and str(fifo) in err and "regular file" in err
    assert not (tmp_path / "out").exists()


def test_import_names_both_source_keys_that_become_one_entry(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({"module.w": torch.ones(3), "w": torch.zeros(3)}, tmp_path / "dup.safetensors")
    code, _, err = _run(
        capsys, "import", tmp_path / "dup.safetensors", tmp_path / "out", "--strip-prefix", "module."
    )
    assert code == EXIT_USAGE and "'module.w'" in err and "'w'" in err and "model/w" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_that_cannot_write_names_the_file_and_leaves_nothing(ckpt, tmp_path, fmt):
    """A write that fails (here: the file size limit, as a full disk would) was an internal error with a
    traceback (safetensors' ``SafetensorError``, torch's ``RuntimeError: unexpected pos``)."""
    import subprocess
    import sys

    out = tmp_path / ("hf" if fmt == "safetensors" else "m.pt")
    body = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))\n"
        "from arraycheckpoint.cli import main\n"
        f"sys.exit(main(['export', {str(ckpt)!r}, {str(out)!r}, '--format', {fmt!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "Traceback" not in proc.stderr and "cannot write" in proc.stderr and str(tmp_path) in proc.stderr
    assert sorted(os.listdir(tmp_path)) == (["ck", "hf"] if fmt == "safetensors" else ["ck"])
    assert not (tmp_path / "hf").exists() or os.listdir(tmp_path / "hf") == []


@pytest.mark.parametrize("size", ["nan", "inf", "-1", "0.1"])
def test_export_refuses_a_shard_size_that_is_no_byte_count(ckpt, tmp_path, capsys, size):
    code, _, err = _run(capsys, "export", ckpt, tmp_path / "hf", "--max-shard-size", size)
    assert code == EXIT_USAGE and "cannot parse size" in err


def test_negative_step_and_non_finite_tolerance_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``import --step -5`` and ``diff --atol nan`` (or a negative one) were accepted; now exit 2, one line."""
    for args in (
        ["import", tmp_path / "x.safetensors", tmp_path / "out", "--step", "-5"],
        ["diff", tmp_path / "a", tmp_path / "b", "--atol", "nan"],
        ["diff", tmp_path / "a", tmp_path / "b", "--atol", "-1"],
        ["diff", tmp_path / "a", tmp_path / "b", "--atol", "inf"],
    ):
        with pytest.raises(SystemExit) as exited:
            run_main(capsys, *args)
        err = capsys.readouterr().err
        assert exited.value.code == EXIT_USAGE and ("negative" in err or "finite" in err), (args, err)


def test_export_never_touches_a_file_linked_in_place_of_its_temporary(tmp_path: Path) -> None:
    """Another user of a shared output directory swaps the export's temporary file for a link to their
    victim's file while the export runs: the victim's mode stays, nothing of it is installed as the output
    (the temporary was reopened by path: chmod followed the link, and the link became the output)."""
    import glob
    import stat

    import numpy as np

    from arraycheckpoint.errors import ArrayCheckpointError
    from arraycheckpoint.tools import export as E
    from arraycheckpoint.tools.common import open_checkpoint

    acp.save(tmp_path / "ck", {"model": {"a": np.ones(4, np.float32)}})
    victim = tmp_path / "victim"
    victim.write_text("SECRET")
    victim.chmod(0o600)
    out = tmp_path / "shared"
    out.mkdir()
    ck = open_checkpoint(str(tmp_path / "ck"))

    def attacker(_size: int) -> None:
        for tmp in glob.glob(str(out / ".model-*.tmp")):
            os.unlink(tmp)
            os.symlink(victim, tmp)

    with pytest.raises(ArrayCheckpointError, match="replaced while exporting"):
        E.export_safetensors(ck, str(out), E.select(ck), 1 << 20, progress=attacker)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "SECRET"
    assert not any(p.is_symlink() for p in out.iterdir() if not p.name.startswith("."))
    assert not list(out.glob("*.safetensors")) and not (out / "model.safetensors.index.json").exists()


def test_export_refuses_a_directory_in_the_way_before_writing(tmp_path: Path) -> None:
    """With --overwrite, a directory where a file of the export goes is refused before anything is written:
    the old export stays whole (the commit failed half-way with IsADirectoryError, the old files gone)."""
    import numpy as np

    from arraycheckpoint.errors import ArrayCheckpointError
    from arraycheckpoint.tools import export as E
    from arraycheckpoint.tools.common import open_checkpoint

    acp.save(tmp_path / "ck", {"model": {"a": np.ones(4, np.float32)}})
    out = tmp_path / "out"
    (out / "config.json").mkdir(parents=True)
    (out / "model-00001-of-00002.safetensors").write_text("old export")
    (out / "model.safetensors.index.json").write_text("{}")
    ck = open_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(ArrayCheckpointError, match="in the way"):
        E.export_safetensors(
            ck, str(out), E.select(ck), 1 << 20, overwrite=True, extra_files={"config.json": {"a": 1}}
        )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert (out / "model-00001-of-00002.safetensors").read_text() == "old export"
