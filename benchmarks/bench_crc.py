"""What the checksum and the copies cost per GiB on the large-tensor save path (issue 15, item 3).

Measures, on one ``--mib`` buffer, the best of ``--repeats`` (least disturbed by other work on the machine):

* ``memcpy``: one copy of the bytes (what tensorstore's copy into its write buffer costs);
* ``tensorstore crc32c``: tensorstore encoding one sharded chunk with the default preset's codecs into an
  in-memory store, minus the same without the ``crc32c`` codec (its portable software CRC32C);
* ``google_crc32c``: the hardware CRC32C arraycheckpoint's own chunk encoder uses, straight from the buffer.

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

    from arraycheckpoint.codecs import array_metadata
    from arraycheckpoint.engine.shardfile import crc32c

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
        "google_crc32c (hardware), from the buffer": best(lambda: crc32c(data), args.repeats),
    }
    gib = n / (1 << 30)
    print(f"{args.mib} MiB, best of {args.repeats}; seconds per GiB (GB/s):")
    for k, v in rows.items():
        print(f"  {k:45s} {v / gib:.3f} s/GiB  ({n / v / 1e9:.2f} GB/s)")
    sw = rows["tensorstore encode + write, with crc32c"] - rows["tensorstore encode + write, no crc32c"]
    print(
        f"  tensorstore's software crc32c (difference)   {sw / gib:.3f} s/GiB  ({n / max(sw, 1e-9) / 1e9:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
