"""Test suites shipped with the package, for backends and adapters written outside it.

:mod:`arraycheckpoint.testing.storage` holds the storage conformance suite: subclass
:class:`~arraycheckpoint.testing.storage.StorageTests` and supply a ``base_url`` fixture. Importing these
modules needs pytest; the package itself never imports them.

Layer ``testing``: the top; may import anything, and nothing imports it.
"""

from __future__ import annotations

import os
from pathlib import Path


def chunk_files(array_dir: str | os.PathLike[str]) -> list[Path]:
    """The stored chunk files of one array directory, sorted: ``c.<i>.<j>`` (format 3) or ``c/<i>/<j>``
    (formats 1 and 2), and ``c`` for a 0-d array."""
    root = Path(array_dir)
    out = [p for p in root.iterdir() if p.is_file() and (p.name == "c" or p.name.startswith("c."))]
    if (root / "c").is_dir():
        out.extend(p for p in (root / "c").rglob("*") if p.is_file())
    return sorted(out)
