"""DCP's discovery file (``.metadata``) in a checkpoint :class:`~arraycheckpoint.interop.dcpwriter.Writer`
saves: what it holds, its late write on stores that commit in place (after the commit marker, so a step scan
never finds an uncommitted step), and writing it again where that late write failed."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ArrayCheckpointError
from ..sources.dcpkeys import DISCOVERY_FILE
from ..storage import storage_for


def discovery_document() -> bytes:
    """The content of the DCP discovery file (``.metadata``) a Writer's checkpoint holds: not DCP's pickle, a
    note naming the format (DCP-style resume discovery only checks that the file exists)."""
    return json.dumps(
        {
            "format": "arraycheckpoint",
            "note": "an arraycheckpoint checkpoint (this file lets DCP-style resume discovery find it); "
            "read it with arraycheckpoint.dcp.Reader or arraycheckpoint.load, not FileSystemReader",
        }
    ).encode()


def write_late(storage: Any, final: str, late: dict[str, bytes]) -> None:
    """Write ``late`` (the discovery file) into the checkpoint ``final`` just committed; a failure is an error
    saying the step is committed, what is missing and how to write it again (nothing is removed)."""
    for key, data in late.items():
        try:
            storage.write(final, key, data)
        except Exception as e:
            raise ArrayCheckpointError(
                f"DCP save to {final} is committed (arraycheckpoint.load and acp.dcp.Reader read it) but its DCP "
                f"discovery file {key} was not written ({e}): DCP's and torchtitan's step scans do not find it "
                f"until it is; write it with arraycheckpoint.dcp.Writer.write_discovery_file({final!r}), or save "
                "the step again"
            ) from e


def write_discovery_file(path: str | os.PathLike[str]) -> None:
    """Write the DCP discovery file (``.metadata``) of the committed checkpoint at ``path`` again: the one a
    save whose late write of it failed left out (its error names this call). Refuses a path that holds no
    committed checkpoint (a step scan must never find an uncommitted step)."""
    storage, final = storage_for(os.fspath(path))
    if not storage.is_committed(final):
        raise ArrayCheckpointError(
            f"{final} holds no committed checkpoint: its {DISCOVERY_FILE} is not written"
        )
    storage.write(final, DISCOVERY_FILE, discovery_document())
