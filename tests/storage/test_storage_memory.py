"""``memory://`` backend: the conformance suite."""

from __future__ import annotations

import uuid

import pytest

from arraycheckpoint.testing.storage import StorageTests


class TestMemory(StorageTests):
    @pytest.fixture
    def base_url(self) -> str:
        return f"memory://conformance-{uuid.uuid4().hex[:8]}"
