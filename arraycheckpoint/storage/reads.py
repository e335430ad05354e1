"""Reading a document with a size bound through any backend, a user's too (``register_scheme``).

:meth:`.base.Storage.read` takes ``limit`` (the most bytes a valid document holds) since format 3's sources
asked for more than the metadata bound; a backend written for the signature documented before,
``read(root, key)``, is still called that way (:func:`read_bounded`), and the caller checks the size."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

_takes: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def takes_limit(cls: type) -> bool:
    """Whether ``cls.read`` accepts a third argument, ``limit`` (cached per class)."""
    known = _takes.get(cls)
    if known is None:
        try:
            params = list(inspect.signature(cls.read).parameters.values())[1:]  # after self
        except (TypeError, ValueError):  # no signature to read (a builtin): call it as documented now
            known = True
        else:
            kinds = {p.kind for p in params}
            known = (
                any(p.name == "limit" for p in params)
                or inspect.Parameter.VAR_POSITIONAL in kinds
                or sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 3
            )
        _takes[cls] = known
    return known


def read_bounded(storage: Any, root: str, key: str, limit: int) -> bytes | None:
    """``storage.read(root, key, limit)``, or ``storage.read(root, key)`` when its backend overrides ``read``
    with the two-argument signature (the caller checks the size of what comes back)."""
    if takes_limit(type(storage)):
        return storage.read(root, key, limit)
    return storage.read(root, key)
