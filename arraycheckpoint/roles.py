"""Roles: independent checkpoints of one job under one root (``<root>/actor``, ``<root>/critic``).

``role="actor"`` saves to and loads from ``<root>/actor``: a complete committed checkpoint of its own, so roles
are saved, loaded and resharded independently; :func:`list_roles` lists a root's committed roles.
"""

from __future__ import annotations

import os

from .errors import UnsafeNameError
from .format.metadata import check_name, marker_owner

__all__ = ["list_roles", "role_path"]


def role_path(path: str | os.PathLike[str], role: str | None) -> str:
    """``<path>/<role>`` (or ``path`` when ``role`` is None); the role must be one safe name component."""
    url = os.fspath(path)
    if role is None:
        return url
    try:
        if "/" in role:
            raise UnsafeNameError(f"role {role!r} contains '/'")
        check_name(role)
    except UnsafeNameError as e:
        raise UnsafeNameError(f"invalid role {role!r}: use one plain name such as 'actor' ({e})") from None
    return url.rstrip("/") + "/" + role


def list_roles(path: str | os.PathLike[str]) -> list[str]:
    """The roles with a committed checkpoint under the root ``path`` (e.g. ``["actor", "critic"]``)."""
    from .storage import LocalStorage, storage_for

    storage, root = storage_for(os.fspath(path))
    if isinstance(storage, LocalStorage):
        if not os.path.isdir(root):
            return []
        names = [
            n for n in os.listdir(root) if not n.startswith(".") and os.path.isdir(os.path.join(root, n))
        ]
        return sorted(n for n in names if storage.is_committed(os.path.join(root, n)))
    owners = (marker_owner(k) for k in storage.list(root))
    return sorted({o for o in owners if o and "/" not in o})
