"""Capture and restore random-number-generator state: torch (CPU, CUDA), numpy, python ``random``, JAX keys.

:func:`capture` returns plain data (dicts, ints, numpy arrays) that saves without pickle; RNG streams differ
per rank, so save it as a per-rank value::

    state = {"extra_state": {"step": step, "rng": acp.PerRank(rng.capture())}}
    acp.save(path, state)
    ...
    acp.load(path, state)
    rng.restore(state["extra_state"]["rng"].value)   # the next draws equal an uninterrupted run's

Only generators of libraries already imported are captured (this module imports neither torch nor jax).
JAX has no global generator: pass your keys (``capture(jax_keys={"dropout": key})``) and take them back from
:func:`restore`'s return value.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .format.perrank import PerRank

KIND = "arraycheckpoint.rng/1"

__all__ = ["KIND", "capture", "derive", "is_rng_state", "restore"]


def capture(jax_keys: Mapping[str, Any] | None = None, *, cuda: bool = True) -> dict[str, Any]:
    """The current state of every global generator (and the given JAX keys) as plain data."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "kind": KIND,
        "python": {"version": version, "state": np.asarray(internal, dtype=np.uint32), "gauss": gauss},
    }
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = {
        "bit_generator": name,
        "key": np.array(key, dtype=np.uint32),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().numpy().copy()
        if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
    if jax_keys:
        import jax

        state["jax"] = {
            k: {
                "impl": str(jax.random.key_impl(v)),
                "data": np.asarray(jax.random.key_data(v)).copy(),
                "typed": bool(jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)),
            }
            for k, v in jax_keys.items()
        }
    return state


def is_rng_state(value: Any) -> bool:
    """Whether ``value`` came from :func:`capture` (or :func:`derive`)."""
    return isinstance(value, Mapping) and value.get("kind") == KIND


def _np(a: Any, dtype: Any) -> np.ndarray:
    return np.asarray(a.cpu() if hasattr(a, "cpu") else a).astype(dtype, copy=False)


def restore(state: Mapping[str, Any]) -> dict[str, Any]:
    """Set every captured generator back; returns the JAX keys (``{}`` when none were captured).

    Accepts the loaded form too (arrays may come back as torch tensors when saved through the torch adapter).
    """
    if isinstance(state, PerRank):  # as loaded into a target that had no PerRank placeholder
        state = state.value
    if not is_rng_state(state):
        raise ValueError("not an RNG state captured by arraycheckpoint.rng.capture()")
    try:  # everything is checked on throwaway generators first: a damaged part leaves every generator as it was
        staged = _staged(state)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
        why = f"{e.args[0]!r} is missing" if isinstance(e, KeyError) and e.args else str(e).splitlines()[0]
        raise ValueError(f"the RNG state cannot be restored ({why}); no generator was changed") from None
    py_state, np_state, torch_state, cuda_states, cuda_seed, keys = staged
    random.setstate(py_state)
    np.random.set_state(np_state)
    if torch_state is not None or cuda_states is not None or cuda_seed is not None:
        import torch

        if torch_state is not None:
            torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if cuda_seed is not None:
            torch.cuda.manual_seed_all(cuda_seed)
    return keys


def _staged(state: Mapping[str, Any]) -> tuple[Any, Any, Any, Any, Any, dict[str, Any]]:
    """Every generator's new state of :func:`restore`, each tried on a throwaway generator of its kind."""
    py = state["python"]
    gauss = py["gauss"]  # what getstate() gives: None or a float (random.setstate takes anything, and
    if gauss is not None and type(gauss) is not float:  # random.gauss() would then return it, or fail)
        raise TypeError(f"python's cached gauss value must be a float or null, not {type(gauss).__name__}")
    py_state = (int(py["version"]), tuple(int(x) for x in _np(py["state"], np.uint32)), gauss)
    random.Random().setstate(py_state)
    n = state["numpy"]
    np_state = (
        n["bit_generator"],
        _np(n["key"], np.uint32),
        int(n["pos"]),
        int(n["has_gauss"]),
        float(n["cached_gaussian"]),
    )
    np.random.RandomState().set_state(np_state)
    torch_state = cuda_states = cuda_seed = None
    if "torch" in state or "torch_cuda" in state or "torch_cuda_seed" in state:
        import torch

        if "torch" in state:
            torch_state = torch.from_numpy(_np(state["torch"], np.uint8).copy())
            torch.Generator().set_state(torch_state)
        if "torch_cuda" in state and torch.cuda.is_available():
            cuda_states = [torch.from_numpy(_np(s, np.uint8).copy()) for s in state["torch_cuda"]]
        if "torch_cuda_seed" in state and torch.cuda.is_available():
            cuda_seed = int(state["torch_cuda_seed"])
    keys: dict[str, Any] = {}
    if state.get("jax"):
        import jax

        for k, v in state["jax"].items():
            key = jax.random.wrap_key_data(np.asarray(_np(v["data"], np.uint32)), impl=v["impl"])
            keys[k] = key if v.get("typed", True) else jax.random.key_data(key)
    return py_state, np_state, torch_state, cuda_states, cuda_seed, keys


def _seed(state: Mapping[str, Any], rank: int) -> int:
    h = hashlib.sha256(f"{rank}".encode())
    for part in ("python", "numpy"):
        arr = state[part]["state"] if part == "python" else state[part]["key"]
        h.update(_np(arr, np.uint32).tobytes())
    if "torch" in state:
        h.update(_np(state["torch"], np.uint8).tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def derive(state: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """A new RNG state for ``rank`` derived deterministically from ``state`` (a saved rank's) and ``rank``.

    Used when a job resumes on more ranks than it saved: the extra ranks get fresh, distinct, reproducible
    streams instead of copies of another rank's.
    """
    seed = _seed(state, rank)
    out: dict[str, Any] = {"kind": KIND}
    version, internal, gauss = random.Random(seed).getstate()
    out["python"] = {"version": version, "state": np.asarray(internal, dtype=np.uint32), "gauss": gauss}
    name, key, pos, has_gauss, cached = np.random.RandomState(seed & 0xFFFFFFFF).get_state(legacy=True)
    out["numpy"] = {
        "bit_generator": name,
        "key": np.array(key, dtype=np.uint32),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    if "torch" in state:
        import torch

        out["torch"] = torch.Generator().manual_seed(seed).get_state().numpy().copy()
    if "torch_cuda" in state or "torch_cuda_seed" in state:
        out["torch_cuda_seed"] = seed
    if state.get("jax"):
        import jax

        out["jax"] = {}
        for k, v in state["jax"].items():
            key = jax.random.fold_in(
                jax.random.wrap_key_data(np.asarray(_np(v["data"], np.uint32)), impl=v["impl"]), rank
            )
            out["jax"][k] = {
                "impl": v["impl"],
                "data": np.asarray(jax.random.key_data(key)).copy(),
                "typed": v.get("typed", True),
            }
    return out
