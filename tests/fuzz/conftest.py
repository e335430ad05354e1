"""Fixtures of the fuzz suite: the sandbox (corpus, outside, work), built once per session, and the runner
that drives every selected case in isolated worker processes, a few at a time."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forked
import pytest
from fuzz.corpus import ITEMS, Item, build_bases, make_outside, snapshot
from fuzz.entry import WRITERS

#: Seconds a case may take (a FIFO item: a reader that waits on the FIFO is a hang, found sooner).
TIMEOUT_S = 90.0
FIFO_TIMEOUT_S = 15.0
#: Cases run at once (each in its own process).
PARALLEL = 4


@dataclass
class Sandbox:
    root: Path
    outside: Path
    corpus: Path
    work: Path
    good: Path

    def frozen(self) -> dict[str, tuple]:
        """Everything no case may change: the sandbox without the cases' own work directories."""
        return snapshot(self.root, skip=("work",))


class Runner:
    """Runs cases ``(item, entry)`` and keeps their outcomes."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sb = sandbox
        self.ctx = forked.context()  # a case pays a fork, not the imports of the code it drives
        self.outcomes: dict[tuple[str, str], dict[str, Any]] = {}
        self.state = sandbox.frozen()
        self._lock = threading.Lock()

    def _path(self, item: Item, entry: str, work: Path) -> tuple[Path, Path]:
        """Where the case reads the item and what lies outside it: the shared corpus and outside, or, for an
        entry point that writes, a private rebuild with a private outside (a case that moves or deletes
        something outside then harms only itself, and is named)."""
        if item.kind != "manager" and entry not in WRITERS:
            return self.sb.corpus / item.name, self.sb.outside
        outside = work / "outside"
        make_outside(outside)
        if item.kind == "manager":
            item.build(work / "root", outside)
            return work / "root", outside
        if entry == "manager":
            (work / "root").mkdir()
            item.build(work / "root" / "step_00000001", outside)
            return work / "root", outside
        item.build(work / "item", outside)
        return work / "item", outside

    def _run(self, item: Item, entry: str) -> dict[str, Any]:
        work = self.sb.work / f"{item.name}--{entry}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        path, outside = self._path(item, entry, work)
        shared = path.is_relative_to(self.sb.corpus)
        before = snapshot(path) if shared and path.is_dir() else None
        private = None if shared else snapshot(outside)
        timeout = FIFO_TIMEOUT_S if item.fifo else TIMEOUT_S
        parent, child = self.ctx.Pipe(duplex=False)
        from fuzz.entry import child as body

        proc = self.ctx.Process(
            target=body, args=(child, entry, item.kind, str(path), str(work), str(self.sb.good))
        )
        start = time.monotonic()
        proc.start()
        child.close()
        result: dict[str, Any]
        if parent.poll(timeout):
            try:
                result = parent.recv()
            except EOFError:
                result = {"kind": "died"}
        else:
            result = {"kind": "hang"}
        proc.join(1 if result["kind"] != "hang" else 0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if result["kind"] == "died":
            result["msg"] = f"the worker died (exit code {proc.exitcode})"
        result["seconds"] = round(time.monotonic() - start, 2)
        if before is not None and snapshot(path) != before:
            result["changed_item"] = True
        if private is not None and snapshot(outside) != private:
            result["changed_outside"] = True
        with self._lock:  # the shared sandbox: blame the case that finds it changed, then start afresh
            now = self.sb.frozen()
            if now != self.state:
                result["changed_outside"] = True
                self.state = now
        return result

    def run_all(self, cases: list[tuple[str, str]]) -> None:
        todo = [c for c in dict.fromkeys(cases) if c not in self.outcomes]
        with ThreadPoolExecutor(PARALLEL) as pool:
            for case, result in zip(todo, pool.map(lambda c: self._run(ITEMS[c[0]], c[1]), todo)):
                self.outcomes[case] = result

    def outcome(self, item: str, entry: str) -> dict[str, Any]:
        if (item, entry) not in self.outcomes:
            self.run_all([(item, entry)])
        return self.outcomes[(item, entry)]


@pytest.fixture(scope="session")
def fuzz_sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    root = tmp_path_factory.mktemp("fuzz")
    sb = Sandbox(root, root / "outside", root / "corpus", root / "work", root / "bases" / "packed")
    make_outside(sb.outside)
    build_bases(root / "bases")
    sb.corpus.mkdir()
    for item in ITEMS.values():
        if item.kind != "manager":
            item.build(sb.corpus / item.name, sb.outside)
    sb.work.mkdir()
    yield sb


@pytest.fixture(scope="session")
def fuzz_runner(fuzz_sandbox: Sandbox, request: pytest.FixtureRequest) -> Runner:
    """The runner, with every fuzz case selected in this session already run (in parallel)."""
    runner = Runner(fuzz_sandbox)
    cases = [
        (it.callspec.params["item"], it.callspec.params["entry"])
        for it in request.session.items
        if hasattr(it, "callspec")
        and {"item", "entry"} <= set(it.callspec.params)
        and it.get_closest_marker("fuzz_case") is not None
    ]
    runner.run_all(cases)
    dump = os.environ.get("ACP_FUZZ_DUMP")
    if dump:  # every outcome, for whoever triages the suite
        with open(dump, "w") as f:
            json.dump({f"{i}-{e}": o for (i, e), o in runner.outcomes.items()}, f, indent=1)
    return runner


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuzz_case: one (corpus item, entry point) case of the fuzz suite")
