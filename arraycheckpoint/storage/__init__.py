"""Storage backends behind one seam. :func:`storage_for` picks the backend from a path or URL.

=====================  ===========================================  ==========================
URL                    backend                                      commit
=====================  ===========================================  ==========================
``/path``, ``file://`` :class:`LocalStorage` (tensorstore ``file``)  atomic rename
``memory://name``      :class:`MemoryStorage` (tensorstore memory)  marker ``.acp/committed``
``s3://bucket/prefix`` :class:`S3Storage` (tensorstore ``s3``)       marker ``.acp/committed``
any other fsspec URL   :class:`FsspecStorage` (fsspec upload)       marker ``.acp/committed``
=====================  ===========================================  ==========================

Backend options (S3 endpoint, region, credentials, fsspec storage options) are set per scheme with
:func:`configure`; environment variables are the default. :func:`register_scheme` plugs in a backend.

Layer ``storage``: where bytes go. May import ``errors``, ``codecs``, ``checks``, ``planning``, ``format``,
``runtime`` and ``adapters`` (it uses no adapter); never the engine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .base import Storage
from .local import LocalStorage
from .memory import MemoryStorage
from .retry import RetryPolicy

__all__ = [
    "LocalStorage",
    "MemoryStorage",
    "RetryPolicy",
    "Storage",
    "configure",
    "register_scheme",
    "storage_for",
    "storage_options",
]

_registry: dict[str, Callable[[], Storage]] = {}
_options: dict[str, dict[str, Any]] = {}
_guard = threading.Lock()


def register_scheme(scheme: str, factory: Callable[[], Storage] | None) -> None:
    """Route URLs ``<scheme>://...`` to ``factory()`` (None removes the registration).

    Registered schemes take precedence over the built-in ones, so a subclass can wrap a backend (for example
    to add instrumentation or inject failures in tests). Each process that saves or loads must register.

    Example:
        >>> register_scheme("audited", lambda: AuditedLocalStorage())
        >>> acp.save("audited:///data/ckpt", state)
    """
    with _guard:
        if factory is None:
            _registry.pop(scheme, None)
        else:
            _registry[scheme] = factory


def configure(scheme: str, **options: Any) -> None:
    """Set default options of the backend for ``scheme`` (merged over earlier calls; None removes a key).

    ``s3``: ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
    ``profile``, ``requester_pays``, ``max_retries``, ``request_concurrency``, ``low_speed_seconds``; unset ones come from
    ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` and ``AWS_PROFILE``.
    Other fsspec schemes: keyword arguments of ``fsspec.filesystem(scheme, **options)``.

    Example:
        >>> configure("s3", endpoint="http://127.0.0.1:9000", region="us-east-1")
    """
    with _guard:
        current = _options.setdefault(scheme, {})
        for key, value in options.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value


def storage_options(scheme: str) -> dict[str, Any]:
    """The options set with :func:`configure` for ``scheme`` (a copy)."""
    with _guard:
        return dict(_options.get(scheme, {}))


def storage_for(url: str | os.PathLike[str]) -> tuple[Storage, str]:
    """The backend for ``url`` and the normalised checkpoint root.

    Local paths and ``file://`` use :class:`LocalStorage`; ``memory://`` uses :class:`MemoryStorage`;
    ``s3://`` tensorstore's S3 driver; any other scheme goes through fsspec. Every call returns a fresh
    backend object (one per save or load).
    """
    url = os.fspath(url)
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    with _guard:
        factory = _registry.get(scheme)
    if factory is not None:
        backend: Storage = factory()
    elif scheme == "file":
        backend = LocalStorage()
    elif scheme == "memory":
        backend = MemoryStorage()
    else:
        from .remote import remote_storage  # object stores and fsspec URLs

        backend = remote_storage(scheme)
    return backend, backend.normalize(url)
