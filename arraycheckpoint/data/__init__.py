"""Dataloader checkpointing: the resharding protocol and a reference resumable token-buffer loader.

See ``docs/dataloader.md``. Put a loader implementing :class:`ReshardableLoader` in the saved state
(``{"dataloader": loader}``); on load, the same call restores it, merging or splitting its shards when the
DP size changed.

Layer ``adapters`` (beside :mod:`arraycheckpoint.adapters`, whose load jobs it uses): may import ``errors``,
``codecs``, ``checks``, ``planning``, ``format``, ``runtime`` and ``adapters``.
"""

from __future__ import annotations

from .protocol import (
    LoaderState,
    PrefetchingLoader,
    ReshardableLoader,
    SavedLoaderState,
    ShardKey,
    ShardState,
)
from .reshard import buffer_owner, range_count, split_ranges
from .tokenbuffer import NumberedSource, TokenBufferLoader, decode_tokens, encode_token

__all__ = [
    "LoaderState",
    "NumberedSource",
    "PrefetchingLoader",
    "ReshardableLoader",
    "SavedLoaderState",
    "ShardKey",
    "ShardState",
    "TokenBufferLoader",
    "buffer_owner",
    "decode_tokens",
    "encode_token",
    "range_count",
    "split_ranges",
]
