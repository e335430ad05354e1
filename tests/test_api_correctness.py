"""API correctness (issue 13): no silent no-op or wrong load, renames that follow the optimizer, errors
that name the fix. Every test here failed on the code before the fix; comparisons are bit-exact."""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.errors import (
    InvalidArgumentError,
    InvalidStateError,
    MetaDeviceError,
    UnpicklingError,
)


def _mlp(seed: int = 0, hidden: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def _trained(model: torch.nn.Module, opt_cls=torch.optim.AdamW, **kw) -> torch.optim.Optimizer:
    opt = opt_cls(model.parameters(), lr=0.01, **kw)
    for i in range(2):
        torch.manual_seed(100 + i)
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _state_by_fqn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(st) for p, st in opt.state.items()}


# ---------------------------------------------------------------------------------- 1: meta device
class _Rotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(2, dtype=torch.float32), persistent=False)
        self.register_buffer("count", torch.tensor(7))


def test_meta_model_is_refused_without_device_naming_the_fix(tmp_path):
    acp.save(tmp_path / "ck", {"model": _mlp()})
    with torch.device("meta"):
        target = _mlp()
    with pytest.raises(MetaDeviceError, match=r"model/0\.weight.*device=.*to_empty"):
        acp.load(tmp_path / "ck", {"model": target})


def test_meta_model_materialises_from_the_checkpoint(tmp_path):
    model = _mlp()
    opt = _trained(model)
    acp.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    with torch.device("meta"):
        target = _mlp(seed=1)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    acp.load(tmp_path / "ck", {"model": target, "optimizer": target_opt}, device="cpu")
    for (k, v), w in zip(model.state_dict().items(), target.state_dict().values()):
        assert w.device.type == "cpu" and torch.equal(v, w), k
    want, got = _state_by_fqn(model, opt), _state_by_fqn(target, target_opt)
    assert want.keys() == got.keys()
    for fqn in want:
        for key in want[fqn]:
            assert torch.equal(want[fqn][key], got[fqn][key]), (fqn, key)
    target(torch.randn(2, 4)).sum().backward()
    target_opt.step()  # the optimizer holds the materialised parameters


def test_meta_non_persistent_buffer_is_refused_by_name(tmp_path):
    acp.save(tmp_path / "ck", {"model": _Rotary()})
    with torch.device("meta"):
        target = _Rotary()
    with pytest.raises(MetaDeviceError, match=r"model/inv_freq.*non-persistent"):
        acp.load(tmp_path / "ck", {"model": target}, device="cpu")
    assert target.proj.weight.is_meta  # refused before anything changed


def test_partly_meta_model_keeps_its_real_non_persistent_buffers(tmp_path):
    src = _Rotary()
    acp.save(tmp_path / "ck", {"model": src})
    target = _Rotary()
    target.proj.to_empty(device="meta")
    acp.load(tmp_path / "ck", {"model": target}, device="cpu")
    assert torch.equal(target.proj.weight, src.proj.weight) and torch.equal(target.count, src.count)
    assert torch.equal(target.inv_freq, torch.arange(2, dtype=torch.float32))


def test_meta_state_dict_is_refused(tmp_path):
    acp.save(tmp_path / "ck", {"model": _mlp()})
    sd = {k: torch.empty_like(v, device="meta") for k, v in _mlp().state_dict().items()}
    with pytest.raises(MetaDeviceError, match="pass the module"):
        acp.load(tmp_path / "ck", {"model": sd})


# ---------------------------------------------------------------------------------- 2: key_map -> optimizer
class _Renamed(torch.nn.Module):
    def __init__(self, seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(4, 8)
        self.act = torch.nn.Tanh()
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.act(self.inp(x)))


RENAMES = {
    "model/inp.weight": "model/0.weight",
    "model/inp.bias": "model/0.bias",
    "model/out.weight": "model/2.weight",
    "model/out.bias": "model/2.bias",
}


@pytest.mark.parametrize("as_function", [False, True])
def test_key_map_renames_follow_into_the_optimizer(tmp_path, as_function):
    model = _mlp()
    opt = _trained(model)
    acp.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    target = _Renamed()
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    key_map = (lambda n: RENAMES.get(n, n)) if as_function else RENAMES
    acp.load(tmp_path / "ck", {"model": target, "optimizer": target_opt}, key_map=key_map)
    want = _state_by_fqn(model, opt)
    got = _state_by_fqn(target, target_opt)
    for new, old in RENAMES.items():
        old_fqn, new_fqn = old.split("/", 1)[1], new.split("/", 1)[1]
        assert want[old_fqn].keys() == got[new_fqn].keys()
        for key, value in want[old_fqn].items():
            assert torch.equal(value, got[new_fqn][key]), (new_fqn, key)
    assert target_opt.param_groups[0]["lr"] == 0.01


# ---------------------------------------------------------------------------------- 3: key_map forms
class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8, bias=False)  # [8, 4]: the stored 0.weight's shape
        self.b = torch.nn.Linear(8, 4, bias=False)  # [4, 8]: not


def test_two_targets_of_one_stored_name_are_each_checked(tmp_path):
    model = _mlp()
    acp.save(tmp_path / "ck", {"model": model})
    key_map = {"model/a.weight": "model/0.weight", "model/b.weight": "model/0.weight"}
    with pytest.raises(acp.StateMismatchError, match=r"model/b\.weight \(stored as model/0\.weight\)"):
        acp.load(tmp_path / "ck", {"model": _TwoHeads()}, key_map=key_map)
    target = _TwoHeads()
    before = target.b.weight.clone()
    report: dict = {}
    acp.load(tmp_path / "ck", {"model": target}, key_map=key_map, strict=False, report=report)
    assert torch.equal(target.a.weight, model[0].weight) and torch.equal(target.b.weight, before)
    assert any(m.startswith("model/b.weight") for m in report["mismatched"])


def test_key_map_without_namespace_is_refused(tmp_path):
    acp.save(tmp_path / "ck", {"model": _mlp()})
    with pytest.raises(InvalidArgumentError, match=r"'inp\.weight'.*'model/inp\.weight'"):
        acp.load(tmp_path / "ck", {"model": _Renamed()}, key_map={"inp.weight": "0.weight"})


# ---------------------------------------------------------------------------------- 4: skipped state
def test_shape_mismatch_with_strict_false_skips_the_parameters_optimizer_state(tmp_path):
    model = _mlp(hidden=4)
    opt = _trained(model)
    acp.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    target = _mlp(seed=3, hidden=5)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    report: dict = {}
    acp.load(tmp_path / "ck", {"model": target, "optimizer": target_opt}, strict=False, report=report)
    got = _state_by_fqn(target, target_opt)
    assert set(got) == {"2.bias"}  # the only parameter whose shape did not change
    assert all(torch.equal(v, _state_by_fqn(model, opt)["2.bias"][k]) for k, v in got["2.bias"].items())
    assert "optimizer/0.weight/step" in report["skipped"]
    assert any(m.startswith("optimizer/0.weight/exp_avg:") for m in report["mismatched"])
    target(torch.randn(2, 4)).sum().backward()
    target_opt.step()  # no misshapen state


# ---------------------------------------------------------------------------------- 5, 8: extra state
def test_extra_state_names_are_injective(tmp_path):
    t1, t2 = torch.arange(3.0), torch.arange(4.0) + 10
    extra = {"a/b": t1, "a": {"b": t2}, "x~sy": torch.ones(2), "x/y": torch.zeros(2)}
    meta = acp.save(tmp_path / "ck", {"extra_state": extra})
    assert len([n for n in meta.tensors if n.startswith("extra_state/")]) == 4
    out = acp.load(tmp_path / "ck", {"extra_state": {}})["extra_state"]
    assert torch.equal(out["a/b"], t1) and torch.equal(out["a"]["b"], t2)
    assert torch.equal(out["x~sy"], torch.ones(2)) and torch.equal(out["x/y"], torch.zeros(2))


def test_numpy_arrays_come_back_as_numpy(tmp_path):
    arr = np.linspace(0, 1, 5, dtype=np.float32)
    t = torch.arange(3)
    acp.save(tmp_path / "ck", {"extra_state": {"arr": arr, "t": t, "n": [np.int16(3), arr[:2]]}})
    out = acp.load(tmp_path / "ck", {"extra_state": {}})["extra_state"]
    assert type(out["arr"]) is np.ndarray and np.array_equal(out["arr"], arr)
    assert type(out["n"][1]) is np.ndarray and out["n"][0] == 3
    assert isinstance(out["t"], torch.Tensor) and torch.equal(out["t"], t)


def test_per_rank_values_into_an_empty_dict_restore_rng(tmp_path):
    from arraycheckpoint import rng

    torch.manual_seed(11)
    acp.save(tmp_path / "ck", {"extra_state": {"rng": acp.PerRank(rng.capture())}})
    expected = torch.rand(3)
    out = acp.load(tmp_path / "ck", {"extra_state": {}})["extra_state"]
    assert isinstance(out["rng"], acp.PerRank)
    rng.restore(out["rng"])
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------------------- 6: EMA of DTensors
def _ema_body(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = {"w": torch.randn(7, 5), "b": torch.randn(5, dtype=torch.bfloat16)}
    ema = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    acp.save(os.path.join(root, "ck"), {"model": _mlp(), "ema": ema, "extra_state": {"decay": 0.99}})
    # reshard: other placements, then plain full tensors
    target = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(len(v.shape) - 1)]) for k, v in full.items()
    }
    acp.load(os.path.join(root, "ck"), {"ema": target})
    plain = {k: torch.zeros_like(v) for k, v in full.items()}
    acp.load(os.path.join(root, "ck"), {"ema": plain})
    # beside per-rank values (the arraycheckpoint.stateful path): saved sharded, loaded whole
    acp.save(os.path.join(root, "pr"), {"extra_state": {"ema": ema["w"], "rank": acp.PerRank(rank)}})
    mixed = acp.load(os.path.join(root, "pr"), {"extra_state": {}})["extra_state"]
    if not (torch.equal(mixed["ema"], full["w"]) and mixed["rank"].value == rank):
        return False
    return all(torch.equal(target[k].full_tensor(), v) and torch.equal(plain[k], v) for k, v in full.items())


@pytest.mark.multiprocess
def test_ema_dict_of_dtensors_reshards_like_parameters(tmp_path):
    assert run_distributed(_ema_body, world=2, args=(str(tmp_path),)) == [True, True]


# ---------------------------------------------------------------------------------- 7: tied weights
class _Tied(torch.nn.Module):
    def __init__(self, tied: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight


def test_tied_checkpoint_loads_into_untied_model(tmp_path):
    src = _Tied(tied=True)
    opt = _trained_tied(src)
    acp.save(tmp_path / "ck", {"model": src, "optimizer": opt})
    target = _Tied(tied=False, seed=1)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    acp.load(tmp_path / "ck", {"model": target, "optimizer": target_opt})
    assert torch.equal(target.emb.weight, src.emb.weight) and torch.equal(target.head.weight, src.emb.weight)
    assert target.head.weight is not target.emb.weight
    state = _state_by_fqn(target, target_opt)
    assert torch.equal(state["head.weight"]["exp_avg"], opt.state[src.emb.weight]["exp_avg"])


def _trained_tied(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.head(model.emb(torch.arange(3))).sum().backward()
    opt.step()
    return opt


def test_untied_checkpoint_with_equal_weights_loads_into_tied_model(tmp_path):
    src = _Tied(tied=False)
    with torch.no_grad():
        src.head.weight.copy_(src.emb.weight)
    acp.save(tmp_path / "ck", {"model": src})
    target = _Tied(tied=True, seed=1)
    acp.load(tmp_path / "ck", {"model": target})
    assert target.head.weight is target.emb.weight and torch.equal(target.emb.weight, src.emb.weight)


def test_untied_checkpoint_with_different_weights_into_tied_model_names_both(tmp_path):
    acp.save(tmp_path / "ck", {"model": _Tied(tied=False)})
    with pytest.raises(acp.StateMismatchError, match=r"model/head\.weight and model/emb\.weight"):
        acp.load(tmp_path / "ck", {"model": _Tied(tied=True, seed=1)})


# ---------------------------------------------------------------------------------- 9: optimizer type
def test_optimizer_type_mismatch_fails_strict_and_is_skipped_otherwise(tmp_path):
    model = _mlp()
    acp.save(tmp_path / "ck", {"model": model, "optimizer": _trained(model)})
    target = _mlp(seed=1)
    sgd = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(acp.StateMismatchError, match=r"exp_avg.*SGD \['momentum_buffer'\]"):
        acp.load(tmp_path / "ck", {"model": target, "optimizer": sgd})
    report: dict = {}
    acp.load(tmp_path / "ck", {"model": target, "optimizer": sgd}, strict=False, report=report)
    assert not sgd.state and torch.equal(target[0].weight, model[0].weight)
    assert any("momentum_buffer" in m for m in report["mismatched"])
    assert sgd.param_groups[0]["lr"] == 0.1 and sgd.param_groups[0]["momentum"] == 0.9  # its own, kept


def test_optimizer_keys_are_compared_under_the_restored_hyper_parameters(tmp_path):
    model = _mlp()
    opt = _trained(model, torch.optim.Adam, amsgrad=True)
    acp.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    target = _mlp(seed=1)
    target_opt = torch.optim.Adam(target.parameters(), lr=0.5)  # amsgrad=False until the groups load
    acp.load(tmp_path / "ck", {"model": target, "optimizer": target_opt})
    assert target_opt.param_groups[0]["amsgrad"] is True
    want, got = _state_by_fqn(model, opt), _state_by_fqn(target, target_opt)
    assert all(torch.equal(want[f][k], got[f][k]) for f in want for k in want[f])
    assert all("max_exp_avg_sq" in st for st in got.values())


# ---------------------------------------------------------------------------------- 10: errors
class _Gone:
    def __init__(self) -> None:
        self.v = 1


def test_errors_name_the_fix(tmp_path):
    model = _mlp()
    acp.save(tmp_path / "ck", {"model": model})
    with pytest.raises(InvalidStateError, match="framework='torch'"):
        acp.load(tmp_path / "ck", {"model": model}, framework="jax")
    with pytest.raises(InvalidStateError, match="StatefulDataLoader"):
        acp.save(tmp_path / "dl", {"model": model, "data": torch.utils.data.DataLoader(list(range(4)))})
    with pytest.raises(InvalidStateError, match=r"\{'model': model\}"):
        acp.save(tmp_path / "x", model)
    with pytest.raises(InvalidArgumentError, match=r"save\(\) got unknown keyword argument\(s\) 'stpe'"):
        acp.save(tmp_path / "x", {"model": model}, stpe=3)
    with pytest.raises(InvalidStateError, match="same call") as e:
        acp.save(tmp_path / "x", {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert isinstance(e.value, ValueError)
    with pytest.raises(acp.CheckpointNotFoundError, match="does not exist"):
        acp.load(tmp_path / "nowhere", {"model": model})
    (tmp_path / "empty").mkdir()
    with pytest.raises(acp.CheckpointNotFoundError, match="exists but holds no committed checkpoint"):
        acp.load(tmp_path / "empty", {"model": model})
    with pytest.raises(acp.CheckpointNotFoundError, match="exists but holds no committed checkpoint"):
        acp.read_metadata(tmp_path / "empty")
    with pytest.raises(acp.CheckpointNotFoundError, match=r"holds committed checkpoints in ck"):
        acp.load(tmp_path, {"model": model})


def test_unimportable_pickled_class_names_the_entry(tmp_path):
    acp.save(tmp_path / "ck", {"extra_state": {"obj": _Gone()}}, allow_pickle=True)
    saved = sys.modules[__name__]._Gone
    del sys.modules[__name__]._Gone
    try:
        with pytest.raises(UnpicklingError, match=r"extra_state/obj.*importable") as e:
            acp.load(tmp_path / "ck", {"extra_state": {}}, allow_pickle=True)
        assert isinstance(e.value, pickle.UnpicklingError)
    finally:
        sys.modules[__name__]._Gone = saved


# ---------------------------------------------------------------------------------- module extra state
class _WithExtra(torch.nn.Module):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.tag = {"name": tag, "scale": torch.tensor([1.5, 2.5]) if tag == "saved" else torch.zeros(2)}

    def get_extra_state(self):
        return self.tag

    def set_extra_state(self, state):
        self.tag = state


def test_module_extra_state_is_restored(tmp_path):
    src = torch.nn.Sequential(_WithExtra("saved"))
    acp.save(tmp_path / "ck", {"model": src})
    dst = torch.nn.Sequential(_WithExtra("fresh"))
    acp.load(tmp_path / "ck", {"model": dst})
    assert dst[0].tag["name"] == "saved" and torch.equal(dst[0].tag["scale"], torch.tensor([1.5, 2.5]))


# ---------------------------------------------------------------------------------- 1 under FSDP2
def _fsdp2_meta_body(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(hidden=7)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = _trained(model)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {
        (names[id(p)], k): v.full_tensor() for p, st in opt.state.items() for k, v in st.items() if v.ndim
    }
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    acp.save(os.path.join(root, "ck"), {"model": model, "optimizer": opt})
    with torch.device("meta"):
        target = _mlp(hidden=7)
    for layer in (target[0], target[2], target):
        fully_shard(layer, mesh=mesh)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    acp.load(os.path.join(root, "ck"), {"model": target, "optimizer": target_opt}, device="cpu")
    names = {id(p): n for n, p in target.named_parameters()}
    got = {
        (names[id(p)], k): v.full_tensor()
        for p, st in target_opt.state.items()
        for k, v in st.items()
        if v.ndim
    }
    ok = all(torch.equal(v.full_tensor(), full[k]) for k, v in target.state_dict().items())
    ok = ok and got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    target(torch.randn(2, 4)).sum().backward()
    target_opt.step()
    return ok


@pytest.mark.multiprocess
def test_fsdp2_model_built_on_meta_materialises_and_trains(tmp_path):
    assert run_distributed(_fsdp2_meta_body, world=2, args=(str(tmp_path),)) == [True, True]


def test_meta_tensors_in_extra_state_are_replaced_not_left(tmp_path):
    ema = {"w": torch.randn(3, 2)}
    acp.save(tmp_path / "ck", {"ema": ema})
    target = {"w": torch.empty(3, 2, device="meta")}
    out = acp.load(tmp_path / "ck", {"ema": target})["ema"]
    assert not out["w"].is_meta and torch.equal(out["w"], ema["w"])
