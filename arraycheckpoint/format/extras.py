"""Arbitrary training state (step, RNG, scheduler, user dicts) as JSON plus arrays, without pickle.

:func:`encode` turns nested Python values into a JSON document in which arrays and tensors are replaced by
references to separately stored Zarr arrays; :func:`decode` inverts it. Tuples, non-string dict keys, bytes
and non-finite floats are tagged so they come back as they went in, and so are torch and numpy dtypes (by name:
megatron's distributed optimizer keys its ``per_bucket_numel`` by ``(param dtype, grad dtype)``). Anything
else needs pickle, which is refused unless the caller opts in with ``allow_pickle=True`` on save *and* on load.
"""

from __future__ import annotations

import base64
import math
import pickle  # only behind allow_pickle=True
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InconsistentCheckpointError, PickleNotAllowedError, UnpicklingError, UnsafeNameError
from .metadata import check_name

# "__leaf__" is no tag of this module's: it marks the numeric leaves of per-rank templates (rankdoc.py), so a
# user dict with that key is stored in the tagged "__dict__" form
_TAGS = (
    "__tuple__",
    "__dict__",
    "__bytes__",
    "__float__",
    "__array__",
    "__pickle__",
    "__module__",
    "__leaf__",
    "__dtype__",
)


def encode(
    value: Any,
    prefix: str,
    is_array: Callable[[Any], bool],
    allow_pickle: bool = False,
    is_module: Callable[[Any], bool] | None = None,
    modules: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Encode ``value``; returns ``(json_doc, {array_name: array})`` with names under ``prefix``.

    ``is_array`` says which leaves are arrays/tensors (the adapter knows its framework's types).
    ``is_module`` says which values are stored as namespaces of their own (torch modules nested in a dict):
    each becomes ``{"__module__": name}`` in the document and ``modules[name] = value``; its name is its
    escaped path under ``prefix``, as injective as array names, and the caller stores its tensors under it.
    Raises :class:`PickleNotAllowedError` naming the path of a value JSON cannot hold.
    """
    arrays: dict[str, Any] = {}
    taken = arrays if modules is None else _Union(arrays, modules)

    def name_for(path: list[str]) -> str:
        # escaped components keep names injective: {"a/b": x} and {"a": {"b": y}} are two arrays
        candidate = "/".join([prefix, *(_escape(p) for p in path)]) if path else prefix
        try:
            check_name(candidate)
        except UnsafeNameError:
            candidate = ""
        n = len(arrays)
        while not candidate or candidate in taken:
            candidate, n = f"{prefix}/~a{n}", n + 1
        return candidate

    def enc(v: Any, path: list[str]) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return v if math.isfinite(v) else {"__float__": repr(v)}
        dtype = _dtype_name(v)
        if dtype is not None:
            return {"__dtype__": dtype}
        if is_array(v):
            name = name_for(path)
            arrays[name] = v
            return {"__array__": name}
        if is_module is not None and modules is not None and path and is_module(v):
            name = name_for(path)
            modules[name] = v
            return {"__module__": name}
        if isinstance(v, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(v)).decode()}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"__tuple__": [enc(x, [*path, str(i)]) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, [*path, str(i)]) for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and k not in _TAGS for k in v):
                return {k: enc(x, [*path, k]) for k, x in v.items()}
            return {"__dict__": [[enc(k, [*path, "key"]), enc(x, [*path, str(k)])] for k, x in v.items()]}
        if hasattr(v, "item") and getattr(v, "shape", None) == () and not is_array(v):
            return enc(v.item(), path)  # numpy scalars
        if allow_pickle:
            return {"__pickle__": base64.b64encode(pickle.dumps(v)).decode()}
        where = "/".join([prefix, *path])
        if hasattr(v, "state_dict") and hasattr(v, "parameters"):  # a module where only plain values go
            raise PickleNotAllowedError(
                f"{where}: a {type(v).__name__} module sits in a namespace that also holds PerRank values or "
                "stateful objects, where only plain values are stored; give the module a namespace of its own "
                "(e.g. state['ema'] = {'m': module}), where it is saved and resharded like 'model'"
            )
        raise PickleNotAllowedError(
            f"{where}: a {type(v).__name__} cannot be stored as JSON; convert it to plain data (dicts, lists, "
            "numbers, strings, tensors) or pass allow_pickle=True to save and load"
        )

    return enc(value, []), arrays


class _Union:
    """Membership in either of two dicts (array and module names share one name space)."""

    def __init__(self, a: dict[str, Any], b: dict[str, Any]) -> None:
        self.a, self.b = a, b

    def __contains__(self, name: object) -> bool:
        return name in self.a or name in self.b


def _escape(component: str) -> str:
    """A path component with ``/`` (the separator) and ``~`` (the escape) escaped: ``~`` -> ``~~``, ``/`` -> ``~s``."""
    return component.replace("~", "~~").replace("/", "~s")


def decode(
    doc: Any,
    arrays: dict[str, Any],
    allow_pickle: bool = False,
    where: str = "",
    modules: Mapping[str, Any] | None = None,
) -> Any:
    """Inverse of :func:`encode`. ``arrays`` maps the stored array names to loaded arrays.

    ``where`` (the entry's name) prefixes the path of a value in errors. ``modules`` maps the names of
    nested namespaces (``{"__module__": name}``) to their loaded values; a ``__module__`` document whose
    name is not in it is an ordinary dict (checkpoints written before nested modules were stored).

    Raises:
        PickleNotAllowedError: the document holds a pickled value and ``allow_pickle`` is False.
        UnpicklingError: a pickled value could not be restored (its class is not importable); the
            entry path is named.
    """

    def dec(v: Any, path: str = where) -> Any:
        if isinstance(v, list):
            return [dec(x, f"{path}/{i}") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            return v
        if len(v) == 1:
            ((tag, body),) = v.items()
            if tag in _TAG_BODIES and not _TAG_BODIES[tag](body):
                raise _malformed(path, tag, body)
            if tag == "__tuple__":
                return tuple(dec(x, f"{path}/{i}") for i, x in enumerate(body))
            if tag == "__dict__":
                try:
                    return {_hashable(dec(k, path)): dec(x, f"{path}/{k}") for k, x in body}
                except TypeError as e:  # a key that cannot be one (a dict)
                    raise _malformed(path, tag, body, str(e)) from None
            if tag == "__bytes__":
                return _b64(body, path, tag)
            if tag == "__float__":
                return float(body)
            if tag == "__dtype__":
                return _dtype(body, path)
            if tag == "__array__":
                if body not in arrays:
                    raise _malformed(path, tag, body, "no such stored array")
                return arrays[body]
            if tag == "__module__" and modules is not None and isinstance(body, str) and body in modules:
                return modules[body]
            if tag == "__pickle__":
                if not allow_pickle:
                    raise PickleNotAllowedError(
                        f"{path or 'a value'}: the checkpoint holds a pickled value; pass allow_pickle=True to "
                        "load it (only for checkpoints you trust: unpickling runs code)"
                    )
                data = _b64(body, path, tag)
                try:
                    return pickle.loads(data)  # noqa: S301 - explicit opt-in
                except Exception as e:  # noqa: BLE001 - any failure of user code run by pickle
                    raise UnpicklingError(
                        f"{path or 'a value'}: the pickled value could not be restored "
                        f"({type(e).__name__}: {e}); make its class importable under the module path it "
                        "was saved from (install or import that code) before loading"
                    ) from e
        return {k: dec(x, f"{path}/{k}") for k, x in v.items()}

    return dec(doc)


#: what each tag's body must be (the tags :func:`encode` writes); a stored value is untrusted input
_TAG_BODIES: dict[str, Callable[[Any], bool]] = {
    "__tuple__": lambda b: isinstance(b, list),
    "__dict__": lambda b: isinstance(b, list) and all(isinstance(p, list) and len(p) == 2 for p in b),
    "__bytes__": lambda b: isinstance(b, str),
    "__float__": lambda b: isinstance(b, str) and b in ("nan", "inf", "-inf"),
    "__array__": lambda b: isinstance(b, str),
    "__pickle__": lambda b: isinstance(b, str),
    "__dtype__": lambda b: isinstance(b, str) and len(b) <= 64,
}

#: the kinds of numpy dtype stored by name (numbers and booleans: no objects, records, strings or dates)
_NUMPY_KINDS = "biufc"


def _dtype_name(v: Any) -> str | None:
    """``"torch.<name>"`` for a ``torch.dtype``, ``"numpy.<name>"`` for a numeric numpy dtype, else None
    (types checked by module and name: this layer imports no framework)."""
    t = type(v)
    if t.__name__ == "dtype" and t.__module__ == "torch":
        return str(v)  # "torch.float32"
    kind, name = getattr(v, "kind", None), getattr(v, "name", None)
    numeric = kind in tuple(_NUMPY_KINDS) and isinstance(name, str) and name.isidentifier()
    if t.__module__.startswith("numpy") and numeric:
        return f"numpy.{name}"
    return None


def _dtype(body: str, path: str) -> Any:
    """The dtype stored as ``body`` (:func:`_dtype_name`): only a name that is one of torch's dtypes or a
    numeric numpy dtype is taken (a stored name is untrusted: no attribute of another kind is returned)."""
    module, _, name = body.partition(".")
    if name.isidentifier() and module == "torch":
        import torch

        found = getattr(torch, name, None)
        if isinstance(found, torch.dtype):
            return found
    elif name.isidentifier() and module == "numpy":
        import numpy as np

        try:
            with warnings.catch_warnings():  # a deprecated alias ("a") warns: refused below, never raised
                warnings.simplefilter("ignore")
                found = np.dtype(name)
        except (TypeError, ValueError):
            found = None
        if found is not None and found.kind in _NUMPY_KINDS and found.name == name:
            return found
    raise _malformed(path, "__dtype__", body, "not a torch dtype or a numeric numpy dtype")


def _malformed(path: str, tag: str, body: Any, why: str = "") -> InconsistentCheckpointError:
    shown = repr(body)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return InconsistentCheckpointError(
        f"{path or 'a value'}: malformed stored value {{{tag!r}: {shown}}}{f' ({why})' if why else ''}: the "
        "checkpoint's metadata is damaged or was edited"
    )


def referenced(tensors: Mapping[str, Any], ref: str, where: str) -> Any:
    """The stored array ``ref`` a document of entry ``where`` refers to.

    Raises:
        InconsistentCheckpointError: no such array is stored (a damaged or edited document)."""
    found = tensors.get(ref)
    if found is None:
        raise InconsistentCheckpointError(
            f"{where or 'a value'}: refers to the stored array {ref!r}, which the checkpoint does not hold"
        )
    return found


def _b64(body: str, path: str, tag: str) -> bytes:
    try:
        return base64.b64decode(body, validate=True)
    except ValueError as e:  # binascii.Error
        raise _malformed(path, tag, body, "not base64") from e


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def array_refs(doc: Any, tag: str = "__array__", where: str = "") -> list[str]:
    """Names of every array (or, with ``tag="__module__"``, nested namespace) a document refers to.

    Raises:
        InconsistentCheckpointError: a reference is not a name (a damaged or edited document; ``where``,
            the entry, is named)."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if len(v) == 1 and tag in v:
                if not isinstance(v[tag], str):
                    raise _malformed(where, tag, v[tag])
                out.append(v[tag])
            else:
                for x in v.values():
                    walk(x)

    walk(doc)
    return out
