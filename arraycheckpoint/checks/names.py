"""Entry names: the one validator of the names a checkpoint stores (saves, loads, tools and sources use it).

A name comes from a user's state (a save) or from an untrusted checkpoint (a load): either way it becomes a
path below the checkpoint root, a ZIP member name and a zarr node, so it is checked once, here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

#: Characters no component of an entry name may hold (besides control characters, see :func:`check_name`).
_FORBIDDEN_NAME_CHARS = ("\\", ":")

#: A component every rule of :func:`check_name` accepts, by construction: ASCII letters, digits, ``_``, ``-``
#: and ``.``, not starting with ``.`` or ``__``, not ``zarr.json``. Most names (torch FQNs) are made of these
#: only, and one match of the whole name is several times cheaper than the component-by-component checks
#: (saves and loads of 100,000 small tensors check as many names). A name it does not match takes the full
#: checks, which decide.
_COMPONENT = r"(?!\.|__|zarr\.json(?:/|\Z))[A-Za-z0-9_.\-]+"
_PLAIN_NAME = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*\Z")


def check_name(name: Any) -> str:
    """Validate a checkpoint entry name (``model/layers.0.w``) and return it: the one validator of names.

    The metadata parser (every load, every tool), every save (before anything is written), the rename
    journal, the sources and the importer all call this, so a save never commits a name a load refuses.
    Components are separated by ``/``; each must be non-empty, must not be ``.``/``..`` or start with ``.``
    (reserved for the format's own files) or ``__`` (reserved by Zarr v3), must not be ``zarr.json``, and must
    not contain ``\\``, ``:``, NUL or any other control character (a newline broke every listing of the
    array's files), nor a lone surrogate (not UTF-8: no file or ZIP member can carry it). Absolute names are
    refused.

    Raises:
        UnsafeNameError: naming the offending name and component.
    """
    if isinstance(name, str) and _PLAIN_NAME.match(name) is not None:
        return name
    from ..errors import UnsafeNameError

    if not isinstance(name, str) or not name:
        raise UnsafeNameError(f"invalid entry name {name!r}: names must be non-empty strings")
    if name.startswith("/"):
        raise UnsafeNameError(f"entry name {name!r} is absolute; names are relative to the checkpoint root")
    for part in name.split("/"):
        if (
            not part
            or part.startswith(".")
            or part.startswith("__")
            or any(c in part for c in _FORBIDDEN_NAME_CHARS)
            or not _printable_utf8(part)
        ):
            raise UnsafeNameError(
                f"entry name {name!r} has an unsafe component {part!r}: components must be non-empty, must not "
                "start with '.' or '__' and must not contain '\\', ':', NUL, another control character or a "
                "lone surrogate (rename the key before saving)"
            )
        if part == "zarr.json":
            raise UnsafeNameError(f"entry name {name!r} clashes with Zarr's metadata file name")
    return name


def _printable_utf8(part: str) -> bool:
    """No control character (C0, DEL, C1) and no lone surrogate in ``part``."""
    if part.isascii():
        return part.isprintable()
    import unicodedata

    return not any(unicodedata.category(c) in ("Cc", "Cs") for c in part)


def check_name_tree(names: Iterable[str], what: str = "tensor") -> None:
    """Refuse a set of array names in which one is a path prefix of another (``model/a`` and ``model/a/b``):
    an array cannot live inside another array's directory (or pack key), so such a checkpoint never loads.

    One set lookup per name component (plus a sort, for a deterministic error). Raises :class:`UnsafeNameError` naming both.
    """
    from ..errors import UnsafeNameError

    every = set(names)
    for name in every:  # the common case, unsorted: nothing is nested (every prefix before a "/" looked up)
        head, sep, _ = name.rpartition("/")
        while sep and head not in every:
            head, sep, _ = head.rpartition("/")
        if sep:
            break
    else:
        return
    for name in sorted(every):  # something is: the first in sorted order is reported
        parts = name.split("/")
        for i in range(1, len(parts)):
            outer = "/".join(parts[:i])
            if outer in every:
                raise UnsafeNameError(
                    f"{what} {name!r} would be stored inside {what} {outer!r} (an array cannot hold another "
                    "array); rename one of them before saving"
                )
