"""What the checksum and the copies cost per GiB on the large-tensor save path (issue 15, item 3).

Measures, on one ``--mib`` buffer, the best of ``--repeats`` (least disturbed by other work on the machine):

* ``memcpy``: one copy of the bytes (what tensorstore's copy into its write buffer costs);
* ``tensorstore crc32c``: tensorstore encoding one sharded chunk with the default preset's codecs into an
  in-memory store, minus the same without the ``crc32c`` codec (its portable software CRC32C);
* ``crc32c`` and ``google_crc32c``: the two hardware CRC32C libraries (``arraycheckpoint.codecs.crc`` uses the
  first where it runs in hardware, the second else), straight from the buffer.

and the load side (a warm file of ``--mib`` bytes read into a destination and checksummed, median of
``--repeats`` interleaved rounds): the whole file read with one ``preadv`` then checksummed (every byte read
from memory twice), each block checksummed right after its ``preadv`` (``engine/chunkread.py``: the block
still in the core's cache), and ``mmap`` with the checksum then the copy per block.

Run::

    python benchmarks/bench_crc.py [--mib 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    import tensorstore as ts

    from arraycheckpoint.codecs import array_metadata, crc
    from arraycheckpoint.engine.shardfile import crc32c

    def google(buf: np.ndarray) -> int:
        return crc._google_extend(0, buf)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    n = args.mib << 20
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).view(np.float32).reshape(-1, 1024)
    dest = np.empty_like(data)
    meta = array_metadata(data.shape, data.dtype, data.shape, (data.shape[0] // args.mib, 1024))

    def store(with_crc: bool) -> object:
        m = dict(meta, codecs=[dict(meta["codecs"][0])])
        conf = dict(m["codecs"][0]["configuration"])
        if not with_crc:
            conf["codecs"] = [c for c in conf["codecs"] if c["name"] != "crc32c"]
        m["codecs"][0]["configuration"] = conf
        spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": m}
        return ts.open(spec, create=True).result()

    with_crc, without = store(True), store(False)
    rows = {
        "memcpy": best(lambda: np.copyto(dest, data), args.repeats),
        "tensorstore encode + write, with crc32c": best(lambda: with_crc.write(data).result(), args.repeats),
        "tensorstore encode + write, no crc32c": best(lambda: without.write(data).result(), args.repeats),
        "crc32c package (hardware), from the buffer": best(lambda: crc32c(data), args.repeats),
        "google_crc32c (hardware), from the buffer": best(lambda: google(data), args.repeats),
    }
    gib = n / (1 << 30)
    print(f"{args.mib} MiB, best of {args.repeats}; seconds per GiB (GB/s):")
    for k, v in rows.items():
        print(f"  {k:45s} {v / gib:.3f} s/GiB  ({n / v / 1e9:.2f} GB/s)")
    sw = rows["tensorstore encode + write, with crc32c"] - rows["tensorstore encode + write, no crc32c"]
    print(
        f"  tensorstore's software crc32c (difference)   {sw / gib:.3f} s/GiB  ({n / max(sw, 1e-9) / 1e9:.2f} GB/s)"
    )
    load_side(data.reshape(-1).view(np.uint8), args.repeats)


def load_side(data: np.ndarray, repeats: int) -> None:
    """Read + checksum of a warm file into a destination: whole then checksum, per block, mmap."""
    import mmap
    import os
    import tempfile

    from arraycheckpoint.codecs.crc import extend

    n, mib = data.nbytes, 1 << 20
    dest = np.ones(n, np.uint8)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
        f.write(data.tobytes())
        f.flush()
        fd = f.fileno()

        def whole() -> None:  # one read, then each 1 MiB inner chunk checksummed from memory
            os.preadv(fd, [dest], 0)
            for o in range(0, n, mib):
                extend(0, dest[o : o + mib])

        def blocks(size: int) -> Callable[[], None]:
            def run() -> None:
                crc = 0
                for o in range(0, n, size):
                    block = dest[o : o + size]
                    os.preadv(fd, [block], o)
                    crc = extend(crc, block)

            return run

        mm = mmap.mmap(fd, n, prot=mmap.PROT_READ)
        src = np.frombuffer(mm, np.uint8)

        def mapped() -> None:  # checksum then copy, per 256 KiB block
            crc = 0
            for o in range(0, n, 256 << 10):
                crc = extend(crc, src[o : o + (256 << 10)])
                dest[o : o + (256 << 10)] = src[o : o + (256 << 10)]

        cases: dict[str, Callable[[], None]] = {"read whole, then checksum": whole}
        for k in (64, 256, 1024, 4096):
            cases[f"preadv + checksum per {k} KiB block"] = blocks(k << 10)
        cases["mmap: checksum + copy per 256 KiB block"] = mapped
        cases["preadv only (no checksum), whole"] = lambda: os.preadv(fd, [dest], 0)
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(repeats):
            for k, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    print(f"load side: {n >> 20} MiB warm file into a destination, median of {repeats} interleaved rounds:")
    for k, v in times.items():
        t = sorted(v)[len(v) // 2]
        print(f"  {k:45s} {t * 1e3:8.1f} ms  ({n / t / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
