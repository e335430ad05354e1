"""PyTorch adapter: plain modules, DDP, FSDP1 (flat shards), FSDP2/DTensor, optimizers, extra state."""

from .adapter import TorchAdapter

__all__ = ["TorchAdapter"]
