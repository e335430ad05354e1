"""Command papercuts of issue 13 (item 12) and the DCP import opt-in (issue 12), run in process."""

from __future__ import annotations

import json

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.cli import EXIT_OK, EXIT_USAGE, build_parser, main


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ck"
    acp.save(path, {"model": model, "optimizer": opt, "extra_state": {"step": 1, "t": torch.ones(2)}})
    return path, model


def test_import_of_a_dcp_directory_needs_allow_pickle(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    src = torch.nn.Linear(3, 2)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    code, _, err = _run(capsys, "import", tmp_path / "dcp", tmp_path / "c")
    assert code == EXIT_USAGE and "--allow-pickle" in err and "pickle" in err
    assert not (tmp_path / "c").exists()
    code, out, _ = _run(capsys, "import", tmp_path / "dcp", tmp_path / "c", "--allow-pickle")
    assert code == EXIT_OK and "imported 2 tensors" in out
    dst = torch.nn.Linear(3, 2)
    acp.load(tmp_path / "c", {"model": dst})
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


def test_import_names_the_overwrite_flag_and_knows_its_total_first(tmp_path, capsys):
    from safetensors.torch import save_file

    from arraycheckpoint.tools.importer import import_checkpoint

    st = str(tmp_path / "w.safetensors")
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(7)}, st)
    calls: list[tuple[str, int]] = []
    import_checkpoint(
        st,
        tmp_path / "c",
        progress=lambda n: calls.append(("progress", n)),
        on_total=lambda n: calls.append(("total", n)),
    )
    assert calls[0] == ("total", 4 * (15 + 7)) and sum(n for k, n in calls[1:]) == 4 * 22
    code, _, err = _run(capsys, "import", st, tmp_path / "c")
    assert code == EXIT_USAGE and "--overwrite" in err and "overwrite=True" not in err


def test_verify_no_data_does_not_claim_bytes_checked(ckpt, capsys):
    code, out, _ = _run(capsys, "verify", ckpt[0], "--no-data")
    assert code == EXIT_OK and "bytes checked" not in out and "not read" in out
    code, out, _ = _run(capsys, "verify", ckpt[0])
    assert code == EXIT_OK and "bytes checked" in out


def test_inspect_totals_are_aligned(ckpt, capsys):
    code, out, _ = _run(capsys, "inspect", ckpt[0])
    assert code == EXIT_OK
    tail = out.rstrip().split("\n\n")[-1].splitlines()
    assert [ln.split()[0] for ln in tail] == ["extra_state", "model", "optimizer", "total"]
    columns = {ln.index(" tensors") for ln in tail}
    assert len(columns) == 1, tail


def test_rename_clash_names_both_entries(ckpt, tmp_path, capsys):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"0.weight": "1.weight"}))
    code, _, err = _run(capsys, "rename", ckpt[0], "--map", m)
    assert code == EXIT_USAGE and "'model/0.weight'" in err and "'model/1.weight'" in err


def test_metrics_unknown_kind_is_a_usage_error(ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["metrics", str(ckpt[0]), "--kind", "lod"])
    assert e.value.code == EXIT_USAGE and "invalid choice: 'lod'" in capsys.readouterr().err
    from arraycheckpoint.tools.metrics import phase_table

    with pytest.raises(KeyError, match="unknown metrics kind 'lod'"):
        phase_table({"save": {"0": []}}, "lod")


def test_export_format_has_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    export = sub.choices["export"]
    fmt = next(a for a in export._actions if a.dest == "format")
    assert fmt.help and "safetensors" in fmt.help and "torch" in fmt.help


def test_phase_colours_follow_the_phase_name():
    pytest.importorskip("matplotlib")
    from arraycheckpoint.tools.metrics import phase_color

    known = ["snapshot", "plan", "exchange", "write", "flush", "commit", "read", "read-shared"]
    assert len({phase_color(p) for p in known}) == len(known)
    assert phase_color("write") == phase_color("write") != phase_color("commit")
    assert phase_color("custom") == phase_color("custom")


def test_plot_draws_each_phase_in_its_own_colour_whatever_the_other_phases(tmp_path):
    """The same phase has the same colour in two pictures with different phase sets (not by position)."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from arraycheckpoint.tools.metrics import PhaseTable, phase_color, plot

    def fills(phases: list[str], name: str) -> set[str]:
        table = PhaseTable(
            "save",
            [0],
            phases,
            [[0.01] * len(phases)],
            [[0] * len(phases)],
            {0: [(p, 0.01 * i, 0.01) for i, p in enumerate(phases)]},
        )
        svg = (tmp_path / name).with_suffix(".svg")
        plot(table, svg)
        text = svg.read_text()
        return {h for h in (to_hex(phase_color(p)) for p in ["snapshot", "write", "commit"]) if h in text}

    assert fills(["write"], "one") == {to_hex(phase_color("write"))}
    assert fills(["commit", "write"], "two") == {to_hex(phase_color("commit")), to_hex(phase_color("write"))}
