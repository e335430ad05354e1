"""A newcomer's path: relative and ``..`` paths, saves pending at exit, nothing of the user's ever deleted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4)}}


def _assert_loaded(path: str, seed: int = 0) -> None:
    got = acp.load(path, _zeros())
    for k, v in _state(seed)["model"].items():
        assert torch.equal(got["model"][k], v), k


def _run(script: str, cwd: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


# -- relative and `..` paths -------------------------------------------------------------------------------
def test_dotdot_paths_save_load_and_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    acp.save("../ckpts/ok", _state())
    assert (tmp_path / "ckpts" / "ok").is_dir()
    _assert_loaded("../ckpts/ok")
    _assert_loaded("./../work/../ckpts/ok")
    # the command line, as its module and as the package itself (``python -m arraycheckpoint`` was "No module
    # named arraycheckpoint.__main__")
    for module in ("arraycheckpoint.cli", "arraycheckpoint"):
        proc = subprocess.run(
            [sys.executable, "-m", module, "verify", "../ckpts/ok"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=work,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert proc.returncode == 0 and "BAD" not in proc.stdout, (module, proc.stdout + proc.stderr)


# -- a save pending at interpreter exit -----------------------------------------------------------------------
_SAVE_AT_EXIT = """
    import sys, torch, arraycheckpoint as acp
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}}
    if sys.argv[1] == "manager":
        from arraycheckpoint.manager import CheckpointManager
        mgr = CheckpointManager(sys.argv[2])
        mgr.save(5, state)
    else:
        if sys.argv[1] == "fail":  # fault injection: the commit's storage operation fails
            from arraycheckpoint.storage.local import LocalStorage
            def broken(self, staging, final, overwrite):
                raise OSError(28, "No space left on device")
            LocalStorage.commit = broken
        fut = acp.save_async(sys.argv[2], state)
    print("script done")  # block-buffered (a pipe): shows only if stdio is flushed at exit
"""


def test_save_async_pending_at_exit_is_committed(tmp_path: Path) -> None:
    proc = _run(_SAVE_AT_EXIT, str(tmp_path), "async", "rel/ckpt")
    assert proc.returncode == 0, proc.stderr
    _assert_loaded(str(tmp_path / "rel" / "ckpt"))


def test_manager_save_as_last_call_is_committed(tmp_path: Path) -> None:
    proc = _run(_SAVE_AT_EXIT, str(tmp_path), "manager", "runs")
    assert proc.returncode == 0, proc.stderr
    from arraycheckpoint.manager import CheckpointManager

    mgr = CheckpointManager(str(tmp_path / "runs"))
    assert mgr.all_steps() == [5]
    _assert_loaded(mgr.step_path(5))


def test_save_failing_at_exit_says_so(tmp_path: Path) -> None:
    proc = _run(_SAVE_AT_EXIT, str(tmp_path), "fail", "doomed")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)  # a lost checkpoint is never a success
    assert proc.stdout.endswith("script done\n"), proc.stdout  # stdio flushed before the exit
    assert "FAILED" in proc.stderr and str(tmp_path / "doomed") in proc.stderr, proc.stderr
    assert "No space left on device" in proc.stderr
    assert not (tmp_path / "doomed").exists()


# -- nothing a user had is ever deleted ---------------------------------------------------------------------
def _user_dir(path: Path) -> None:
    (path / "tb_logs").mkdir(parents=True)
    (path / "tb_logs" / "events.out").write_bytes(b"tb")
    (path / "notes.txt").write_text("my notes")


@pytest.mark.parametrize("overwrite", [False, True])
def test_save_into_a_users_directory_refuses_and_keeps_it(tmp_path: Path, overwrite: bool) -> None:
    target = tmp_path / "run"
    _user_dir(target)
    with pytest.raises((CheckpointExistsError, acp.SaveFailedError)) as info:
        acp.save(target, _state(), overwrite=overwrite)
    msg = str(info.value)
    assert "not a checkpoint" in msg and "notes.txt" in msg and "tb_logs/" in msg, msg
    assert (target / "notes.txt").read_text() == "my notes"
    assert (target / "tb_logs" / "events.out").read_bytes() == b"tb"
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no lock, no staging left


def test_save_into_a_file_refuses(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.write_text("data")
    with pytest.raises((CheckpointExistsError, acp.SaveFailedError), match="not a directory"):
        acp.save(target, _state())
    assert target.read_text() == "data"


def test_empty_directory_is_used_and_committed_replaced_only_with_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    acp.save(target, _state(0))  # an empty directory (made by the user) is fine
    _assert_loaded(str(target), 0)
    with pytest.raises((CheckpointExistsError, acp.SaveFailedError), match="already exists"):
        acp.save(target, _state(1))
    _assert_loaded(str(target), 0)
    acp.save(target, _state(1), overwrite=True)
    _assert_loaded(str(target), 1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_commit_refuses_a_directory_that_appeared_during_the_save(tmp_path: Path) -> None:
    from arraycheckpoint.storage.local import LocalStorage

    storage = LocalStorage()
    final = str(tmp_path / "ckpt")
    staging = storage.staging_root(final, "t")
    storage.write(staging, "model/zarr.json", b"{}")
    _user_dir(Path(final))
    with pytest.raises(CheckpointExistsError, match="notes.txt"):
        storage.commit(staging, final, overwrite=True)
    assert (Path(final) / "notes.txt").read_text() == "my notes"
    assert not os.path.exists(os.path.join(final, "model"))


# -- a packed checkpoint opened by its plain path -------------------------------------------------------------
def test_plain_path_reader_sees_the_packed_arrays_hint(tmp_path: Path) -> None:
    import xarray as xr
    import zarr

    acp.save(tmp_path / "c", _state())  # tiny tensors: packed
    hint = zarr.open_group(str(tmp_path / "c"), mode="r").attrs["packed_arrays"]
    assert hint.startswith("2 small arrays") and "arraycheckpoint.zarr.checkpoint_store" in hint
    assert xr.open_zarr(str(tmp_path / "c"), consolidated=False).attrs["packed_arrays"] == hint
    acp.save(tmp_path / "d", _state(), plan_options=acp.PlanOptions(pack_array_bytes=0))
    assert "packed_arrays" not in zarr.open_group(str(tmp_path / "d"), mode="r").attrs


# -- a missing optional dependency ----------------------------------------------------------------------------
def test_cli_without_torch_names_the_extra(tmp_path: Path) -> None:
    acp.save(tmp_path / "c", _state())
    hide = tmp_path / "hide" / "torch"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "arraycheckpoint.cli",
            "export",
            str(tmp_path / "c"),
            str(tmp_path / "out"),
            "--format",
            "torch",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'hide'}{os.pathsep}{REPO}"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'arraycheckpoint[torch]'" in proc.stderr and "internal error" not in proc.stderr


# -- what a path that is not a checkpoint says -------------------------------------------------------------
def test_a_file_is_not_a_checkpoint_and_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"torch.save bytes")
    (tmp_path / "model.safetensors").write_bytes(b"safetensors bytes")
    with pytest.raises(acp.CheckpointNotFoundError, match="is a file, not a checkpoint directory") as e:
        acp.load(tmp_path / "model.pt", _zeros())
    assert "does not exist" not in str(e.value) and "torch.load" in str(e.value)
    with pytest.raises(acp.CheckpointNotFoundError, match="is a file") as e:
        acp.read_metadata(tmp_path / "model.safetensors")
    assert f"the directory holding it ({tmp_path})" in str(e.value)


def test_an_empty_directory_does_not_say_it_does_not_exist(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(acp.CheckpointNotFoundError, match="exists but holds no committed checkpoint") as e:
        acp.load(tmp_path / "empty", _zeros())
    assert "does not exist" not in str(e.value)


def test_a_missing_path_names_the_checkpoints_beside_it(tmp_path: Path) -> None:
    acp.save(tmp_path / "step_100", _state())
    acp.save(tmp_path / "roles", _state(), role="actor")
    with pytest.raises(acp.CheckpointNotFoundError, match="does not exist") as e:
        acp.load(tmp_path / "step_1000", _zeros())
    assert "step_100" in str(e.value).split("does not exist", 1)[1]
    with pytest.raises(acp.CheckpointNotFoundError, match="does not exist") as e:
        acp.load(tmp_path / "roles", _zeros(), role="actr")
    assert "actor" in str(e.value).split("does not exist", 1)[1]


@pytest.mark.parametrize("command", ["inspect", "export", "verify", "metrics"])
def test_cli_explains_a_directory_of_checkpoints_and_a_file(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from arraycheckpoint.cli import main

    acp.save(tmp_path / "ckpts" / "step_100", _state())
    (tmp_path / "model.pt").write_bytes(b"x")
    out = [str(tmp_path / "out")] if command == "export" else []
    for path, expected in [("ckpts", "holds committed checkpoints in step_100"), ("model.pt", "is a file")]:
        assert main([command, str(tmp_path / path), *out]) == 2
        err = capsys.readouterr().err
        assert expected in err and "does not exist" not in err, err


# -- arguments refused before anything runs ----------------------------------------------------------------
def test_unknown_compression_is_refused_before_the_save(tmp_path: Path) -> None:
    for kwargs in [{"compression": "zstandard"}, {"plan_options": acp.PlanOptions(compression="lz4")}]:
        with pytest.raises(acp.InvalidArgumentError, match="compression") as e:
            acp.save(tmp_path / "c", _state(), **kwargs)
        assert "zstd" in str(e.value) and not isinstance(e.value, acp.SaveFailedError)
    assert not (tmp_path / "c").exists()
    acp.save(tmp_path / "c", _state(), compression="ZSTD")  # case as the codec takes it
    _assert_loaded(str(tmp_path / "c"))


def test_unknown_indivisible_mode_is_refused(tmp_path: Path) -> None:
    acp.save(tmp_path / "c", _state())
    with pytest.raises(acp.InvalidArgumentError, match="indivisible.*'replicated'.*'replicate'"):
        acp.load(tmp_path / "c", _zeros(), indivisible="replicated")


# -- what `arraycheckpoint metrics` says a save wrote -------------------------------------------------------
@pytest.mark.parametrize("pack_array_bytes", [0, 2 << 20])
def test_save_metrics_count_every_byte_written(tmp_path: Path, pack_array_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(40)}}
    path = tmp_path / f"c{pack_array_bytes}"
    meta = acp.save(path, state, plan_options=acp.PlanOptions(pack_array_bytes=pack_array_bytes))
    assert all(meta.tensors[n].pack is not None for n in meta.tensors) == bool(pack_array_bytes)
    written = sum(
        p["bytes"] for p in acp.read_metadata(path).metrics["save"]["0"]["phases"] if p["phase"] == "write"
    )
    data = sum(t.nbytes for t in state["model"].values())
    assert data <= written <= data + 4096 * len(state["model"]), (
        written,
        data,
    )  # chunks, index and zarr.json


def test_verify_of_a_hugging_face_directory_says_what_it_is(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from arraycheckpoint.tools.verify import verify

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(acp.CheckpointNotFoundError, match="is a Hugging Face safetensors directory"):
        verify(tmp_path / "hf")
    acp.load(tmp_path / "hf", {"model": {"w": torch.zeros(2)}})  # which acp.load reads


def test_step_must_be_an_integer_before_anything_is_committed(tmp_path: Path) -> None:
    import numpy as np

    for step in ["100", 1.5, True]:
        with pytest.raises(acp.InvalidArgumentError, match="step must be an integer"):
            acp.save(tmp_path / "c", _state(), step=step)  # type: ignore[arg-type]
        assert not (tmp_path / "c").exists()
    for i, step in enumerate([np.int64(7), torch.tensor(8)]):
        acp.save(tmp_path / f"ok{i}", _state(), step=step)  # type: ignore[arg-type]
        assert acp.read_metadata(tmp_path / f"ok{i}").step == 7 + i


# -- a namespace saved from a module loads into its state dict, and the other way round --------------------
@pytest.mark.parametrize("saved_as", ["module", "state_dict"])
@pytest.mark.parametrize("loaded_as", ["module", "state_dict"])
def test_a_module_and_its_state_dict_are_interchangeable_in_any_namespace(
    tmp_path: Path, saved_as: str, loaded_as: str
) -> None:
    torch.manual_seed(0)
    ema = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    saved = ema if saved_as == "module" else ema.state_dict()
    acp.save(tmp_path / "c", {"model": torch.nn.Linear(2, 2), "ema": saved})
    target = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    acp.load(tmp_path / "c", {"ema": target if loaded_as == "module" else target.state_dict()})
    for (name, a), b in zip(ema.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bound", [-5, 0, 1.5, "1GB"])
def test_max_inflight_bytes_must_be_a_positive_integer(tmp_path: Path, bound: object) -> None:
    with pytest.raises(acp.InvalidArgumentError, match="max_inflight_bytes"):
        acp.save(tmp_path / "c", _state(), max_inflight_bytes=bound)  # type: ignore[arg-type]
    acp.save(tmp_path / "c", _state(), max_inflight_bytes=1 << 10)
    with pytest.raises(acp.InvalidArgumentError, match="max_inflight_bytes"):
        acp.load(tmp_path / "c", _zeros(), max_inflight_bytes=bound)  # type: ignore[arg-type]


def test_cli_on_a_dcp_directory_names_the_command_that_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    from arraycheckpoint.cli import main

    dcp.save(_state()["model"], checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for command in (["inspect"], ["export", str(tmp_path / "out")]):
        assert main([command[0], str(tmp_path / "dcp"), *command[1:]]) == 2
        assert "arraycheckpoint import SRC PATH --allow-pickle" in capsys.readouterr().err
