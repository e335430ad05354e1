import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py and shared helpers


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ACP_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set ACP_RUN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
