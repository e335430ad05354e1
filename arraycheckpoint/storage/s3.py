"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores through tensorstore's own ``s3`` kvstore driver.

Every rank writes its chunk files straight to the bucket (no local copy); the commit is the marker strategy:
``.acp/committed`` is written last by the coordinator, and readers treat a prefix without it as absent. S3 has
no rename, and deleting is not atomic: retention removes the marker first, so a half-deleted checkpoint is
never read.

Configuration, first match wins: :func:`arraycheckpoint.storage.configure` ``("s3", ...)`` options, then the
usual environment variables (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``/
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE``), then tensorstore's default credential chain (profile files, ECS, instance metadata).
tensorstore cannot take keys inline, so keys given as options are written to a private (0600) credentials
file for the process.

A stalled server (a request that is never answered) fails within bounds: every small-object request waits at
most :meth:`~.base.Storage.stall_bound` seconds (the save's ``timeout=``). A bulk transfer through tensorstore
is not bounded by ``timeout=``: tensorstore 0.1.86's ``s3`` driver sets no timeout on its requests (neither
its spec nor its context resources have one); its transport aborts a transfer slower than 1 byte/s for
``low_speed_seconds`` (60) seconds (``TENSORSTORE_CURL_LOW_SPEED_*``, process-wide, read once at the process's
first HTTP request), then retries it as below: ``max_retries + 1`` such attempts and the backoff bound it
(docs/storage.md, "A store that stops answering", has what was measured).

tensorstore retries each HTTP request itself (``s3_request_retries``: ``max_retries`` attempts with
exponential backoff from ``initial_delay`` to ``max_delay``); the small-object operations (metadata,
marker, lock, listing) are additionally wrapped in :func:`~.retry.retry_call`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from typing import Any

from ..errors import StorageError
from .base import Storage, check_read_size, read_limit

#: one botocore client per backend, created by one thread
_client_guard = threading.RLock()


class S3Storage(Storage):
    """An S3 bucket prefix. ``s3://bucket`` alone is the bucket's top level."""

    commit_strategy = "marker"

    def __init__(
        self,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        requester_pays: bool = False,
        max_retries: int = 8,
        initial_delay: str = "100ms",
        max_delay: str = "10s",
        request_concurrency: int | None = None,
        low_speed_seconds: int = 60,
    ) -> None:
        env = os.environ
        _watch_stalled_transfers(low_speed_seconds)
        self.endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        # A custom endpoint (MinIO, moto, ...) rarely answers region discovery: default to us-east-1 there.
        self.region = (
            region
            or env.get("AWS_REGION")
            or env.get("AWS_DEFAULT_REGION")
            or ("us-east-1" if self.endpoint else None)
        )
        self.requester_pays = requester_pays
        self.profile = profile
        self._keys = (
            (access_key_id, secret_access_key, session_token) if access_key_id and secret_access_key else None
        )
        self._client: Any = None
        self.context: dict[str, Any] = {
            "s3_request_retries": {
                "max_retries": max_retries,
                "initial_delay": initial_delay,
                "max_delay": max_delay,
            }
        }
        if request_concurrency:
            self.context["s3_request_concurrency"] = {"limit": request_concurrency}
        if access_key_id and secret_access_key:
            path = _credentials_file(access_key_id, secret_access_key, session_token)
            self.credentials: dict[str, Any] = {
                "type": "profile",
                "profile": "default",
                "credentials_file": path,
                "config_file": path,  # tensorstore insists on a readable config file; this one will do
            }
        elif profile:
            self.credentials = {"type": "profile", "profile": profile}
        elif env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            self.credentials = {"type": "environment"}
        else:
            self.credentials = {"type": "default"}

    def normalize(self, url: str) -> str:
        if not url.startswith("s3://"):
            raise StorageError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise StorageError(f"S3 URL {url!r} names no bucket (expected s3://bucket/prefix)")
        prefix = "/".join(p for p in prefix.split("/") if p)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def kvstore_spec(self, root: str) -> dict[str, Any]:
        bucket, _, prefix = root[len("s3://") :].partition("/")
        prefix = prefix.strip("/")
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": bucket,
            "path": prefix + "/" if prefix else "",
            "aws_credentials": self.credentials,
            "context": self.context,
        }
        if self.endpoint:
            spec["endpoint"] = self.endpoint
        if self.region:
            spec["aws_region"] = self.region
        if self.requester_pays:
            spec["requester_pays"] = True
        return spec

    def _botocore(self) -> Any:
        """A botocore S3 client for bounded listings (timeouts of :meth:`stall_bound`, no retries of its own:
        :func:`~.retry.retry_call` retries), or None without botocore or a setup it can use (anonymous
        access, a profile only tensorstore knows): then tensorstore's own listing, unbounded but right."""
        with _client_guard:  # created once: a second thread finds it, not False (reads ahead run on threads)
            return self._create_client()

    def _create_client(self) -> Any:
        if self._client is None:
            self._client = False
            try:
                import botocore.session
                from botocore.config import Config

                names = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
                keys = dict(zip(names, self._keys or ()))
                session = botocore.session.Session(profile=self.profile)
                if not keys and session.get_credentials() is None:
                    raise LookupError("botocore finds no credentials")
                bound = self.stall_bound()  # botocore's defaults: 60 s per read, 5 attempts, per call
                config = Config(
                    connect_timeout=bound,
                    read_timeout=bound,
                    retries={"max_attempts": 1},
                    max_pool_connections=32,  # the packs' ends read ahead (audit.ahead.WORKERS) at once
                )
                self._client = session.create_client(
                    "s3", endpoint_url=self.endpoint, region_name=self.region, config=config, **keys
                )
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        return self._client or None

    def _list_args(self, root: str, **extra: Any) -> tuple[str, dict[str, Any]]:
        bucket, _, prefix = root[len("s3://") :].partition("/")
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, **extra}
        if self.requester_pays:
            args["RequestPayer"] = "requester"
        return prefix, args

    def sample(self, root: str, limit: int) -> list[str]:
        """Up to ``limit`` keys below ``root``: one ``ListObjectsV2`` request with ``MaxKeys`` through botocore
        (tensorstore's listing has no limit and would walk a huge prefix to the end); without botocore
        installed, tensorstore's full listing."""
        client = self._botocore()
        if client is None:
            return super().sample(root, limit)
        prefix, args = self._list_args(root, MaxKeys=limit)
        listed = self._retry("list", root, lambda: client.list_objects_v2(**args))
        return sorted(o["Key"][len(prefix) :] for o in listed.get("Contents", []))[:limit]

    def children(self, root: str) -> list[str]:
        """Names of the immediate children of ``root``: a delimited ``ListObjectsV2`` (one entry per step
        prefix, pages of 1,000 followed to the end) through botocore. tensorstore's listing has no delimiter:
        the manager's every ``latest_step()`` walked every object of every step kept."""
        client = self._botocore()
        if client is None:
            return super().children(root)
        prefix, args = self._list_args(root, Delimiter="/")
        names: set[str] = set()
        while True:
            page = self._retry("list", root, lambda a=dict(args): client.list_objects_v2(**a))
            names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(prefix) :] for o in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(n for n in names if n)
            args["ContinuationToken"] = token

    def read(self, root: str, key: str, limit: int | None = None) -> bytes | None:
        """The object ``root/key`` of at most ``limit`` bytes (:meth:`Storage.read`), or None when absent: one
        GET of its first ``limit + 1`` bytes through botocore, of which no more are read whatever the server
        sends (tensorstore's read downloads the whole object, a hostile metadata file of any size, before its
        size can be checked); through tensorstore without a botocore client."""
        bound = read_limit(limit)
        client = self._botocore()
        if client is None:
            return super().read(root, key, limit)
        args = self._object_args(root, key)
        args["Range"] = f"bytes=0-{bound}"

        def get() -> bytes | None:
            got = _ranged_get(client, args, bound + 1)  # a server ignoring the range: no more is read
            return None if got is None else got[0]

        return check_read_size(f"{root}/{key}", self._retry("read", f"{root}/{key}", get), bound)

    def _object_args(self, root: str, key: str) -> dict[str, Any]:
        """botocore's ``Bucket`` and ``Key`` (and the requester-pays flag) of ``root/key``."""
        bucket, _, prefix = root[len("s3://") :].partition("/")
        name = f"{prefix.strip('/')}/{key}" if prefix.strip("/") else key
        args: dict[str, Any] = {"Bucket": bucket, "Key": name}
        if self.requester_pays:
            args["RequestPayer"] = "requester"
        return args

    def read_suffix(self, root: str, key: str, want: int) -> tuple[bytes, int] | None:
        """The last ``want`` bytes of ``root/key`` (all of it when it is shorter) and its size, in one ranged
        GET through botocore (bounded by :meth:`stall_bound`, retried by :func:`~.retry.retry_call`); None
        when it is absent. tensorstore refuses a suffix longer than the object after fetching it (a pack's
        first read then cost two GETs of the whole pack).

        Raises:
            NotImplementedError: no botocore client (not installed, or a setup only tensorstore knows), or
                the server did not answer the range asked for (a 200 without ``Content-Range``): read it
                through tensorstore. Raised after the retried call, never wrapped as a ``StorageError``.
        """
        client = self._botocore()
        if client is None or want <= 0:
            raise NotImplementedError("no botocore client")
        args = self._object_args(root, key)
        args["Range"] = f"bytes=-{int(want)}"

        def get() -> tuple[bytes, int] | str | None:
            got = _ranged_get(client, args, want + 1)
            if got is None:
                return None
            data, ranged = got
            if ranged is None:  # an empty object has no last bytes to range over
                return b"", 0
            # "bytes <first>-<last>/<size>" (206), or no range at all (200: the whole object)
            total = ranged.rpartition("/")[2]
            if not total.isdigit():  # no Content-Range (200: a server ignoring the range): size unknown
                return (
                    f"an answer without a Content-Range ({len(data)} bytes read of the object, size unknown)"
                )
            size = int(total)
            if len(data) != min(want, size):
                return f"{len(data)} bytes of an object of {size} for its last {want}"
            return data, size

        got = self._retry("read", f"{root}/{key}", get)
        if isinstance(got, str):  # not the answer asked for: the caller reads through tensorstore instead
            raise NotImplementedError(f"suffix read of {root}/{key}: {got}")
        return got

    def parent(self, root: str) -> tuple[str, str]:
        head, _, name = root.rstrip("/").rpartition("/")
        if head in ("s3:", "s3:/"):
            raise StorageError(f"{root} is a bucket; checkpoints live under a prefix (s3://bucket/prefix)")
        return head, name


def _ranged_get(client: Any, args: dict[str, Any], most: int) -> tuple[bytes, str | None] | None:
    """One botocore GET of ``args`` (its ``Range`` set): at most ``most`` bytes of the body (the rest is never
    read) and its ``Content-Range`` (``""`` when the answer has none; None when the range is past an empty
    object's end: S3's ``InvalidRange``); None when the object is absent."""
    try:
        answer = client.get_object(**args)
    except client.exceptions.NoSuchKey:
        return None
    except client.exceptions.ClientError as e:
        if e.response.get("Error", {}).get("Code") == "InvalidRange":
            return b"", None
        raise
    body = answer["Body"]
    try:
        return bytes(body.read(most)), str(answer.get("ContentRange", ""))
    finally:
        body.close()


def _watch_stalled_transfers(seconds: int) -> None:
    """Have tensorstore's HTTP transport abort a transfer that moves no byte for ``seconds`` seconds (curl's
    low-speed watchdog, off by default: a request a stalled server never answers hung the save forever).
    tensorstore reads the variables when it creates its transport (the first HTTP request of the process),
    so the first S3 backend of a process sets them; values the user set are kept."""
    if seconds > 0:
        os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(int(seconds)))
        os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


_cred_files: dict[str, str] = {}


def _credentials_file(key_id: str, secret: str, token: str | None) -> str:
    """A 0600 AWS credentials file with one ``default`` profile, written once per distinct key per process."""
    digest = hashlib.sha256(f"{key_id}\0{secret}\0{token}".encode()).hexdigest()[:16]
    path = _cred_files.get(digest)
    if path and os.path.exists(path):
        return path
    fd, path = tempfile.mkstemp(prefix="acp-aws-", suffix=".ini")
    with os.fdopen(fd, "w") as f:
        f.write(f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
        if token:
            f.write(f"aws_session_token = {token}\n")
    os.chmod(path, 0o600)
    _cred_files[digest] = path
    return path
