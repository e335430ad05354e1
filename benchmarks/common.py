"""Shared helpers of the benchmark scripts: timing, durability, page cache, tables.

Every benchmark follows one protocol (stated in ``docs/benchmarks.md``):

* a save is timed until its bytes are durable: the method's own save call followed by ``os.sync()``, inside
  the timed region, for every method alike;
* a load is timed from the call until the target tensors hold the data;
* each measurement is repeated and the median is reported (the first, warm-up round is not counted);
* the page cache is either left alone for every method (warm loads) or dropped before every load of every
  method (cold loads), never for one method only.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30


def sync() -> None:
    """Make every dirty page of the machine durable (the common fsync policy of all methods)."""
    os.sync()


def can_drop_page_cache() -> bool:
    """Whether this process may drop the kernel page cache (root on Linux with a writable procfs)."""
    path = "/proc/sys/vm/drop_caches"
    return os.path.exists(path) and os.access(path, os.W_OK)


def drop_page_cache() -> None:
    """Write back and drop the clean page cache, so the next read comes from the device."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


#: pause before each timed region (``ACP_BENCH_SETTLE`` overrides: spawned ranks inherit it)
SETTLE_SECONDS = float(os.environ.get("ACP_BENCH_SETTLE", "0.5"))


def settle(seconds: float | None = None) -> None:
    """Pause before a timed region so the previous measurement's after-effects (device cache flushes,
    memory returned to the host of a VM) are not billed to the next method."""
    gc.collect()
    if os.environ.get("ACP_BENCH_DROP_CACHE") == "1" and can_drop_page_cache():
        drop_page_cache()  # diagnostic: every timed region starts with the page cache empty (loads cold too)
    time.sleep(SETTLE_SECONDS if seconds is None else seconds)


@contextlib.contextmanager
def stopwatch(pause: bool = True) -> Iterator[list[float]]:
    """``with stopwatch() as t: ...`` leaves the elapsed seconds in ``t[0]`` and the CPU seconds in ``t[1]``.

    ``pause``: :func:`settle` first (off where background work of the previous region is still being timed).
    CPU seconds are this process's user + system time over all its threads (``time.process_time``): less
    sensitive than wall time to other work on a shared machine, blind to kernel write-back threads.
    """
    if pause:
        settle()
    out = [0.0, 0.0]
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        yield out
    finally:
        out[0] = time.perf_counter() - t0
        out[1] = time.process_time() - c0


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (after a garbage collection, so collection of earlier garbage is not billed)."""
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (NaN when empty)."""
    return statistics.median(xs) if xs else float("nan")


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file or directory tree if it exists."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Total bytes of the files under ``path`` (or of the file itself)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_children_rss_mib() -> float:
    """Peak resident memory of the largest waited-for child process, MiB."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def machine_description(path: str | os.PathLike[str]) -> str:
    """One line naming the CPU, core count, memory, file system of ``path`` and library versions."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / (1 << 20):.0f} GiB RAM"
    fs = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, timeout=10).stdout
        dev, fstype = out.splitlines()[1].split()[:2]
        fs = f", {fstype} on {dev}"
    versions = []
    for dist in ("torch", "tensorstore", "numpy", "safetensors"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
    with contextlib.suppress(ImportError):
        import arraycheckpoint

        where = Path(arraycheckpoint.__file__).parent.parent
        versions.append(f"arraycheckpoint {getattr(arraycheckpoint, '__version__', '?')} from {where}")
    libs = ", ".join(versions)
    return f"{cpu}, {os.cpu_count()} cores{mem}{fs}; Python {platform.python_version()}, {libs}"


def fmt_seconds(x: float) -> str:
    """Seconds with three significant digits ('-' for a missing value)."""
    if x != x:  # NaN
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.2f}"


def fmt_ratio(x: float) -> str:
    """A ratio such as ``2.31x`` ('-' for a missing value)."""
    return "-" if x != x else f"{x:.2f}x"


def ratio(num: float, den: float) -> float:
    """``num / den``, NaN where either is missing or ``den`` is zero."""
    if num != num or den != den or den == 0:
        return float("nan")
    return num / den


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table with columns padded for reading in a terminal too."""
    cols = [list(map(str, col)) for col in zip(headers, *rows)]
    widths = [max(len(c) for c in col) for col in cols]
    align = ["-" * w for w in widths]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), line(align), *(line(r) for r in rows)])


def verdict(ok: bool) -> str:
    """``met`` / ``MISSED`` for a target line."""
    return "met" if ok else "MISSED"
