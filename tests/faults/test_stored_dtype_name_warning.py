"""A stored dtype name that numpy accepts only with a warning (``{"__dtype__": "numpy.a"}``: numpy 2 deprecated
the ``a`` alias) is refused as a damaged value naming its path, also where warnings are errors.

Before: ``np.dtype("a")`` warned, and under ``-W error`` (or ``warnings.simplefilter("error")``, as many test
suites run) the ``DeprecationWarning`` escaped the load instead of an error naming the value."""

from __future__ import annotations

import warnings

import pytest

from arraycheckpoint.errors import InconsistentCheckpointError
from arraycheckpoint.format.extras import decode


@pytest.mark.parametrize("name", ["numpy.a", "numpy.a8"])
def test_a_deprecated_numpy_alias_is_refused_naming_the_value(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InconsistentCheckpointError, match="extra/step/dt.*__dtype__"):
            decode({"dt": {"__dtype__": name}}, {}, where="extra/step")
