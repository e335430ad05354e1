"""The fuzz suite: every entry point on every hostile input of the shared corpus (tests/fuzz/corpus.py).

Each case runs in its own worker process (tests/fuzz/entry.py) with a time bound and a memory bound, and
must end in a clear answer: one of arraycheckpoint's errors (a CLI: exit 2, or 1 for ``verify``/``diff``
reporting damage) whose message names the input's path or a tensor, never a raw exception, a traceback
(exit 3), a hang, a crash or ``MemoryError``. Entry points that never read the damaged part may succeed
(``Item.may_pass``). Nothing outside the corpus item may change (a canary, a victim tree, a FIFO and valid
copies of the files that links point to live in ``outside/``; a reader that followed a link would succeed
instead of refusing). docs/security.md lists the entry points and their checks.

Cases that other branches fix are marked ``xfail(strict=False)`` in :data:`KNOWN` with the branch named;
remove a mark once its fix is merged.
"""

from __future__ import annotations

import pytest
from fuzz.corpus import ITEMS
from fuzz.entry import ENTRIES

#: (item, entry point) -> the branch that fixes it (xfail until merged; then delete the entries)
KNOWN: dict[tuple[str, str], str] = {}

CASES = [
    pytest.param(
        name,
        entry,
        id=f"{name}-{entry}",
        marks=[pytest.mark.fuzz_case]
        + (
            [pytest.mark.xfail(strict=False, reason=f"fixed on branch {KNOWN[(name, entry)]}")]
            if (name, entry) in KNOWN
            else []
        ),
    )
    for name, item in ITEMS.items()
    for entry in ENTRIES[item.kind]
]
TENSOR_WORDS = ("model/w", "model/b", "'w'", "'b'")


@pytest.mark.parametrize(("item", "entry"), CASES)
def test_hostile_input(fuzz_runner, item: str, entry: str) -> None:
    out = fuzz_runner.outcome(item, entry)
    spec = ITEMS[item]
    where = f"{item} through {entry}: {out}"
    assert not out.get("changed_outside"), f"something outside the item was changed: {where}"
    assert not out.get("changed_item"), f"a read-only entry point changed the corpus item: {where}"
    assert out["kind"] not in ("hang", "died"), where
    if out["kind"] == "error":
        assert out["ours"], f"a raw {out['type']} instead of one of arraycheckpoint's errors: {where}"
    if out["kind"] == "exit":
        allowed = (0, 1, 2) if entry in ("verify", "diff") else (0, 2)
        assert out["code"] in allowed, f"exit {out['code']} (3: a traceback): {where}"
    refused = out["kind"] == "error" or (out["kind"] == "exit" and out["code"] != 0)
    if spec.kind == "manager":  # step 1 is the only step: whatever else is in the root is not one
        assert not refused and out.get("latest") == 1, f"the manager did not restore step 1: {where}"
    elif entry not in spec.may_pass:
        assert refused, f"hostile input accepted: {where}"
    if refused:
        msg = out["msg"]
        words = (item, *TENSOR_WORDS, *spec.names)
        assert any(w in msg for w in words), f"the error names neither path nor tensor: {where}"
