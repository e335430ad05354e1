"""Error classes of issue 12 live in the one hierarchy (errors.py) and are exported; ``timeout=`` of the
public verbs is validated before anything else happens."""

from __future__ import annotations

import arraycheckpoint as acp
from arraycheckpoint import errors, liveness, safety


def test_fault_errors_are_exported_from_the_package_and_errors_module() -> None:
    assert acp.StalledRankError is errors.StalledRankError
    assert acp.InconsistentCheckpointError is errors.InconsistentCheckpointError
    assert {"StalledRankError", "InconsistentCheckpointError"} <= set(acp.__all__)
    # both are ArrayCheckpointErrors and keep the builtin they resemble
    assert issubclass(acp.StalledRankError, acp.ArrayCheckpointError)
    assert issubclass(acp.StalledRankError, TimeoutError)
    assert issubclass(acp.InconsistentCheckpointError, acp.MetadataError)
    assert issubclass(acp.InconsistentCheckpointError, acp.CorruptCheckpointError)
    # the old import locations are aliases of the same classes (``except`` clauses keep matching)
    assert liveness.StalledRankError is acp.StalledRankError
    assert safety.InconsistentCheckpointError is acp.InconsistentCheckpointError
