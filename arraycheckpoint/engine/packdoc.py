"""The check of a packed array's ``zarr.json`` against the metadata, cheap in its common case (a load of
thousands of small packed arrays checks thousands of documents): :class:`DocCheck`."""

from __future__ import annotations

import json
from typing import Any

from ..codecs import numpy_dtype


class DocCheck:
    """The check of a packed array's ``zarr.json`` against the metadata (:func:`arraycheckpoint.checks
    .check_packed_doc`), with its common case made cheap: a document byte for byte what a save writes for the
    array is accepted without generating it whole. What a save writes differs between arrays of one layout
    (shape, dtype, chunks, compression) only in the dimension names, which come from the array's last name
    component; so each layout's document is generated once with a placeholder for that component (and checked
    against the whole generation for the array at hand), and each array's is the placeholder replaced. Any
    other document goes to ``check_packed_doc`` (parsed and cross-checked)."""

    _MARK = "\x01acp-leaf\x01"  # never in a name (control characters are refused)

    def __init__(self, separator: str) -> None:
        self._sep = separator
        self._templates: dict[tuple[Any, ...], bytes | None] = {}
        self._leaves: dict[str, bytes] = {}  # last name component -> its JSON text (components repeat)
        self._mark = json.dumps(self._MARK)[1:-1].encode()

    def _exact(self, tm: Any, leaf: str) -> bytes:
        from ..codecs import array_metadata

        doc = array_metadata(
            tuple(tm.shape),
            numpy_dtype(tm.dtype),
            tuple(tm.chunk_shape),
            tuple(tm.inner_chunk_shape),
            tm.compression,
            name=leaf,
            separator=self._sep,
        )
        return json.dumps(doc).encode()

    def check(self, tm: Any, raw: bytes, where: str) -> None:
        """Raises :class:`MetadataError` (``check_packed_doc``) unless ``raw`` is a sound document of ``tm``."""
        leaf = tm.name.rsplit("/", 1)[-1]  # dimension names come from the last component
        key = (tuple(tm.shape), tm.dtype, tuple(tm.chunk_shape), tuple(tm.inner_chunk_shape), tm.compression)
        name = self._leaves.get(leaf)
        if name is None:
            name = self._leaves[leaf] = json.dumps(leaf)[1:-1].encode()
        if key not in self._templates:
            try:
                template = self._exact(tm, self._MARK)
            except ValueError:  # an unsupported layout: check_packed_doc says what is wrong
                template = None
            ok = template is not None and template.replace(self._mark, name) == self._exact(tm, leaf)
            self._templates[key] = template if ok else None
        template = self._templates[key]
        if template is not None and raw == template.replace(self._mark, name):
            return
        from ..audit.arrays import check_packed_doc

        check_packed_doc(tm, raw, f"{where}:{tm.name}", self._sep)
