"""Ranged reads over HTTP that hold and fetch no more than the range asked for, whatever the server sends.

fsspec's ``cat_file`` reads a reply's whole body into memory before anything looks at it: a server that
ignores ``Range`` (Python's ``http.server`` does) sends the whole object for a read of 4 KiB, and a hostile
one as much as it likes. :func:`read_range` streams the reply instead: a ``206`` is read up to one byte more
than the range (a longer one is refused, and so is one whose ``Content-Range`` is not the range asked for),
a ``200`` (the whole object) up to the range's end and no further
(for a suffix: only its last bytes are kept), then the connection is closed.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import StorageError

#: bytes read from a reply at once
_STEP = 1 << 20
#: a ``206`` reply's ``Content-Range``: ``bytes <first>-<last>/<length or *>``
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def is_http(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's HTTP file system (whose replies may be whole objects, whatever was asked)."""
    return "http" in (getattr(fs, "protocol", ()) or ())


def read_range(fs: Any, url: str, start: int | None, stop: int | None, limit: int) -> bytes:
    """Bytes ``[start, stop)`` of the object at ``url`` on fsspec's HTTP file system ``fs`` (``start`` < 0:
    its last ``-start`` bytes; ``stop`` None: to its end); what the object holds of the range when it ends
    first; ``b""`` for a range past its end (416). At most ``limit`` bytes of a reply are looked at beyond the
    range's start (an object larger refused).

    Raises:
        FileNotFoundError: there is no such object (404).
        StorageError: the server's reply is not the range asked for (a ``206`` longer than it, or whose
            ``Content-Range`` names another range or another length than its body's), or a
            reply to an open range is larger than ``limit``.
    """
    from fsspec.asyn import sync

    return sync(fs.loop, _read, fs, url, start or 0, stop, limit)  # type: ignore[no-any-return]


async def _read(fs: Any, url: str, start: int, stop: int | None, limit: int) -> bytes:
    if start < 0:
        wanted = f"bytes={start}"
    else:
        wanted = f"bytes={start}-" + ("" if stop is None else str(stop - 1))
    kw = dict(fs.kwargs)
    headers = {**kw.pop("headers", {}), "Range": wanted}
    session = await fs.set_session()
    r = await session.get(fs.encode_url(url), headers=headers, **kw)
    try:
        if r.status == 404:
            raise FileNotFoundError(url)
        if r.status == 416:
            return b""
        r.raise_for_status()
        if r.status == 206:
            asked = -start if start < 0 else (limit if stop is None else stop - start)
            data = await _take(r, asked + 1)
            if len(data) > asked:
                raise StorageError(
                    f"storage read of {url} failed: the server answered a range of {asked} bytes with more: "
                    "the server's reply is not the range asked for"
                )
            end = _check_content_range(r.headers.get("Content-Range"), url, start, stop, len(data))
            if end is not None and not await _ends_at(session, fs, url, end, kw, headers):
                raise StorageError(
                    f"storage read of {url} failed: the server answered the range asked for with a shorter one "
                    f"(it ends at byte {end - 1} and the object goes on): the server's reply is not the range "
                    "asked for"
                )
            return data
        # the whole object: read to the range's end, no further
        if start < 0:
            return await _tail(r, -start, limit, url)
        end = start + limit if stop is None else stop
        data = await _take(r, end if stop is not None else end + 1)
        if stop is None and len(data) > end:
            raise _too_large(url, limit)
        return data[start:end]
    finally:
        r.close()  # never the rest of the body: the connection goes


async def _take(r: Any, n: int) -> bytes:
    """Up to ``n`` bytes of the body of ``r`` (fewer where it ends first)."""
    parts, got = [], 0
    while got < n:
        part = await r.content.read(min(_STEP, n - got))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


async def _tail(r: Any, n: int, limit: int, url: str) -> bytes:
    """The last ``n`` bytes of the body of ``r``, keeping no more than about ``n`` + a step; a body past
    ``limit`` bytes is refused."""
    kept, total = bytearray(), 0
    while True:
        part = await r.content.read(_STEP)
        if not part:
            return bytes(kept[-n:])
        total += len(part)
        if total > limit:
            raise _too_large(url, limit)
        kept += part
        if len(kept) > 2 * n + _STEP:  # trimmed now and then: linear in what streams by
            del kept[: len(kept) - n]


async def _ends_at(
    session: Any, fs: Any, url: str, end: int, kw: dict[str, Any], headers: dict[str, Any]
) -> bool:
    """Whether the object at ``url`` ends at byte ``end`` (exclusive): a range starting there is refused as
    past its end (416). Asked once, where a ``206`` said no length (``*``) and held less than the range."""
    r = await session.get(fs.encode_url(url), headers={**headers, "Range": f"bytes={end}-"}, **kw)
    try:
        return bool(r.status == 416)
    finally:
        r.close()


def _check_content_range(header: str | None, url: str, start: int, stop: int | None, got: int) -> int | None:
    """Refuse a ``206`` reply whose ``Content-Range`` (``header``) is not the range asked for (``start``,
    ``stop`` as :func:`read_range` takes them) or not the ``got`` bytes its body held: a server answering
    another range would have its bytes read as the ones asked for (at the wrong offset). Returns None, or,
    where the server said no length (``*``) and the reply holds less than the range (or the range is open),
    the byte after the reply's last: the reply is the range only if the object ends there (the caller asks)."""
    m = _CONTENT_RANGE.fullmatch((header or "").strip())
    why = None
    if m is None:
        why = f"its Content-Range is {header!r}, not 'bytes <first>-<last>/<length>'"
    else:
        first, last = int(m[1]), int(m[2])
        total = None if m[3] == "*" else int(m[3])
        want_first, want_last = _wanted(start, stop, total)
        if (
            total is None and start < 0
        ):  # a suffix of an object of unsaid length: its last bytes, if it ends here
            want_first = max(0, last + 1 + start)
        if last - first + 1 != got:
            why = f"it says {last - first + 1} bytes, its body held {got}"
        elif first != want_first:
            why = f"it starts at byte {first}, not {want_first}"
        elif want_last is not None and last > want_last:
            why = f"it ends at byte {last}, past {want_last}"
        elif total is None and (want_last is None or last < want_last):
            return last + 1  # the object's length unsaid: the reply is the range only if the object ends here
        elif want_last is not None and last < want_last:
            why = f"it ends at byte {last}, short of {want_last} (the object holds {total})"
    if why is not None:
        raise StorageError(
            f"storage read of {url} failed: the server answered the range asked for with another one ({why}): "
            "the server's reply is not the range asked for"
        )
    return None


def _wanted(start: int, stop: int | None, total: int | None) -> tuple[int | None, int | None]:
    """The first and last byte a ``206`` for ``start``, ``stop`` (as :func:`read_range` takes them) must hold,
    ``total`` the object's length its ``Content-Range`` says (None: ``*``): the range asked for, ended at the
    object's end where that is known; None where it depends on a length the server did not say."""
    if start < 0:  # a suffix: the object's last bytes
        return (None, None) if total is None else (max(0, total + start), total - 1)
    if total is None:
        return start, None if stop is None else stop - 1
    return start, total - 1 if stop is None else min(stop, total) - 1


def _too_large(url: str, limit: int) -> StorageError:
    return StorageError(
        f"storage read of {url} failed: the object is larger than {limit} bytes, more than a valid checkpoint "
        "stores in one object; the checkpoint is damaged or hostile"
    )
