"""The canonical JSON text of ``.acp/metadata.json``: :func:`metadata_text` of a :class:`CheckpointMetadata`.

The text is ``json.dumps`` of the whole document (compact separators, keys in the order below, no NaN),
written in parts: tensors of one layout and rules share one entry text but for their name, so a save of
100,000 small tensors encodes a handful of distinct entries instead of 100,000 dictionaries. JSON's
encoding is compositional (no indentation), so the parts joined are the bytes of the whole.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_string
from typing import TYPE_CHECKING, Any

from .writers import Writers

if TYPE_CHECKING:
    from .metadata import CheckpointMetadata, ObjectMeta, TensorMeta

#: entries whose listed writers are longer than this are encoded on their own (not worth a key)
_SHARED_WRITERS = 64


def metadata_text(meta: CheckpointMetadata) -> str:
    """``json.dumps`` of ``meta``'s document, one entry text per distinct tensor entry but its name."""
    head = {
        "format_version": meta.format_version,
        "library_version": meta.library_version,
        "codec_preset": meta.codec_preset,
        "framework": meta.framework,
        "world_size": meta.world_size,
        "step": meta.step,
        "topology": dict(meta.topology),
        "roles": list(meta.roles),
        **({"layout_groups": list(meta.layout_groups)} if meta.format_version >= 2 else {}),
    }
    entries: dict[Any, str] = {}
    parts = []
    for name, t in sorted(meta.tensors.items()):
        derived = getattr(t.writers, "derived", False)
        key: Any = None
        if meta.format_version != 1 and (derived or len(t.writers) <= _SHARED_WRITERS):
            # the regions by identity: build_metadata shares one rule text per (group, rule), and every object
            # named here is alive in ``meta`` while this runs
            layout = (
                t.shape,
                t.dtype,
                t.chunk_shape,
                t.inner_chunk_shape,
                t.compression,
                t.rank_rows,
                t.pack,
            )
            key = (
                layout,
                tuple(map(id, t.regions)),
                (True, t.writers.shift) if derived else tuple(t.writers),  # type: ignore[attr-defined]
            )
        try:
            text = entries.get(key) if key is not None else None
        except TypeError:  # a field that cannot be hashed (a list): encoded on its own
            key = text = None
        if text is None:
            text = dumps(tensor_json(t, meta.format_version))
            if key is not None:
                entries[key] = text
        parts.append(f"{_json_string(name)}:{text}")
    objects = {name: object_json(o) for name, o in sorted(meta.objects.items())}
    return (
        f'{dumps(head)[:-1]},"tensors":{{{",".join(parts)}}},'
        f'"objects":{dumps(objects)},"metrics":{dumps(dict(meta.metrics))}}}'
    )


def tensor_json(t: TensorMeta, format_version: int) -> dict[str, Any]:
    """The document of one tensor entry (under its name in ``tensors``)."""
    return {
        "shape": list(t.shape),
        "dtype": t.dtype,
        "chunk_shape": list(t.chunk_shape),
        "inner_chunk_shape": list(t.inner_chunk_shape),
        "compression": t.compression,
        **(
            {"shards": [[list(x.offsets), list(x.lengths), x.rank] for x in t.shards]}
            if format_version == 1  # tools rewriting an old checkpoint keep its format
            else {"regions": [[g, r] for g, r in t.regions]}
        ),
        "writers": t.writers.json if isinstance(t.writers, Writers) else list(t.writers),
        **({"rank_rows": True} if t.rank_rows else {}),
        **({"pack": t.pack} if t.pack is not None else {}),
    }


def object_json(o: ObjectMeta) -> dict[str, Any]:
    """The document of one object entry."""
    if o.scope == "global":
        return {"scope": "global", "value": o.value}
    if o.rows is not None:
        return {"scope": "rank", "template": o.template, "rows": dict(o.rows)}
    return {"scope": "rank", "per_rank": {str(r): v for r, v in sorted(o.per_rank.items())}}


def dumps(value: Any) -> str:
    """The canonical JSON text of ``value`` (compact, no NaN) that ``.metadata.json`` is made of."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)
