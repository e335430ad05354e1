"""torch.distributed.checkpoint directories as a load source (placeholder)."""

from __future__ import annotations

DCP_METADATA = ".metadata"


class DcpSource:
    @classmethod
    def open(cls, storage, root, allow_pickle=False):
        raise NotImplementedError
