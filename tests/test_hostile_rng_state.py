"""A loaded RNG state is untrusted (``arraycheckpoint.rng.restore`` of what a load returned): every damaged value
is a ValueError saying that no generator was changed. Numbers beyond what a generator holds (a numpy position
or cached gaussian of 10^30 or 10^400, an infinite python version) raised a bare OverflowError, and python's
cached gaussian was taken whatever its type (a string or a huge integer: ``random.gauss()`` then returned the
string, or failed in the caller's code)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint import rng

EDITS = {
    "numpy cached gaussian 10^400": lambda s: s["numpy"].__setitem__("cached_gaussian", 10**400),
    "numpy position 10^30": lambda s: s["numpy"].__setitem__("pos", 10**30),
    "numpy has_gauss 10^30": lambda s: s["numpy"].__setitem__("has_gauss", 10**30),
    "python version infinite": lambda s: s["python"].__setitem__("version", float("inf")),
    "python gauss a string": lambda s: s["python"].__setitem__("gauss", "x"),
    "python gauss 10^400": lambda s: s["python"].__setitem__("gauss", 10**400),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_damaged_value_is_refused_and_changes_no_generator(case: str) -> None:
    bad: Any = copy.deepcopy(rng.capture())
    EDITS[case](bad)
    random.seed(11)
    np.random.seed(12)
    before = (random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(ValueError, match="no generator was changed"):
        rng.restore(bad)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])


def test_a_state_with_a_cached_gaussian_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    """The control: python's and numpy's cached gaussians (floats) saved and loaded restore the same draws."""
    random.seed(3)
    np.random.seed(4)
    random.gauss(0, 1)
    np.random.standard_normal()  # each generator now holds a cached gaussian
    state = rng.capture(cuda=False)
    assert type(state["python"]["gauss"]) is float
    acp.save(str(tmp_path / "ck"), {"extra_state": {"rng": state}})
    loaded = acp.load(str(tmp_path / "ck"), {"extra_state": {"rng": None}})["extra_state"]["rng"]
    draws = (random.gauss(0, 1), np.random.standard_normal())
    rng.restore(loaded)
    assert (random.gauss(0, 1), np.random.standard_normal()) == draws
