"""The hostile-checkpoint cases over every storage backend: local files, memory://, S3 (a moto server on
loopback) and fsspec (``local://``). Each case runs in its own process (forked from the suite's preloaded
server: tests/forked.py): one that used to abort the process (``std::bad_alloc``) fails its test instead of
killing pytest."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import cases
import pytest
from flaky import S3Process
from forked import run_forked

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# case -> (expected error type, words the message must hold)
EXPECTED = {
    "chunk_larger_than_shape": ("MetadataError", ["model/bias", "chunk"]),
    "zarr_json_shape_1e13": ("MetadataError", ["model/bias", "zarr.json"]),
    # format 2 refuses the writer list first (one writer for 3e11 chunks): a MetadataError naming the entry
    "extra_state_1e13": (("MetadataError", "InconsistentCheckpointError"), ["extra_state"]),
    "crc32c_off": ("MetadataError", ["model/weight", "crc32c"]),
    "zstd_bomb": ("CorruptCheckpointError", ["model/weight", "zstd frame declares 67108864"]),
    "deep_json": ("MetadataError", ["levels deep"]),
    "oversized_chunk": ("CorruptCheckpointError", ["model/weight", "larger than any encoding"]),
    "flipped_byte": ("CorruptCheckpointError", ["model/weight"]),
    "missing_chunk": ("InconsistentCheckpointError", ["model/weight", "0 chunk file"]),
}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Process]:
    server = S3Process()
    yield server
    server.stop()


@pytest.fixture(params=["local", "memory", "s3", "fsspec"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    env = {}
    tag = uuid.uuid4().hex[:8]
    if request.param == "local":
        url = str(tmp_path / "ck")
    elif request.param == "memory":
        url = f"memory://faults-{tag}/ck"
    elif request.param == "fsspec":
        url = f"local://{tmp_path}/ck"
    else:
        server = request.getfixturevalue("s3")
        url = f"s3://{server.bucket}/{tag}/ck"
        env = {
            "AWS_ACCESS_KEY_ID": "acp-test",
            "AWS_SECRET_ACCESS_KEY": "acp-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": server.endpoint,
        }
    return url, env


def run_case(name: str, url: str, env: dict[str, str]) -> str:
    proc = run_forked(cases.main, name, url, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, (
        f"case {name} killed its process (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    return next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_hostile_case_on_every_backend(case: str, backend: tuple[str, dict[str, str]]) -> None:
    url, env = backend
    out = run_case(case, url, env)
    kind, words = EXPECTED[case]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    assert out.startswith(tuple(f"RAISED {k} " for k in kinds)), out
    for w in words:
        assert w in out, (w, out)


def test_round_trip_on_every_backend(backend: tuple[str, dict[str, str]]) -> None:
    url, env = backend
    assert run_case("round_trip", url, env) == "LOADED equal"
