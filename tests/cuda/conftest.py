"""CUDA tests: skipped where no GPU is visible (CI)."""

import pytest

torch = pytest.importorskip("torch")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "/cuda/" in str(item.fspath):
            item.add_marker(skip)
