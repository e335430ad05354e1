"""Where each key of a :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore` lives, and its listing.

A key of a packed array (``model/w/c.0``) or a group document only a pack holds is served from a pack member;
every other key the metadata names comes from the checkpoint itself. The listing presents both, and only keys
the metadata names (:class:`~arraycheckpoint.format.hierarchy.NamedKeys`): a planted array is no member.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import cached_property
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError
from ..format.hierarchy import NamedKeys, array_above
from ..format.hierarchy import chunk_flat as _chunk_flat
from ..planning.packing import PACK_DIR
from .zarrfiles import _grid
from .zarrpacks import PackReading, _Member, _Pack

__all__ = ["KeyRouting"]


class KeyRouting(PackReading):
    """The routing and listing half of :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore`."""

    _packed: dict[str, str]  # array name -> pack key
    _children: dict[str, set[str]]  # directory -> the packed arrays' path parts below it
    _group_pack: dict[str, str]  # directory above packed arrays -> a pack holding its group document

    if TYPE_CHECKING:

        async def exists(self, key: str) -> bool: ...

    # Routing ----------------------------------------------------------------------------------------------
    def _array_of(self, key: str) -> str | None:
        """The packed array whose key ``key`` is (``model/w/c.0`` -> ``model/w``), else None."""
        return array_above(key, self._packed)

    def _group_of(self, key: str) -> str | None:
        """The directory above packed arrays whose group document ``key`` is, else None."""
        if key == "zarr.json":
            return ""
        if key.endswith("/zarr.json") and key[: -len("/zarr.json")] in self._group_pack:
            return key[: -len("/zarr.json")]
        return None

    async def _member(self, key: str) -> tuple[_Pack, _Member] | None:
        """The pack member serving ``key`` (a packed array's key, or a group document only a pack holds)."""
        name = self._array_of(key)
        if name is not None and self._meta.tensors[name].pack_rank is not None:
            rank = self._rank_of(name, key)
            if rank is None:
                return None
            found = await self._rank_member(rank, key)
            if found is None:  # every chunk has its member (all-zero ones too): a missing one is damage
                raise CorruptCheckpointError(
                    f"tensor {name!r}: {key} is in none of rank {rank}'s packs ({self._where(PACK_DIR)}/"
                    f"{rank}.<k>.zip); the checkpoint is damaged"
                )
            return found
        if name is not None:
            pack = await self._pack(self._packed[name])
            member = pack.members.get(key)
            return None if member is None else (pack, member)
        group = self._group_of(key)
        if group is not None and group in self._group_pack and not await self._base.exists(key):
            pack = await self._pack(self._group_pack[group])
            member = pack.members.get(key)
            return None if member is None else (pack, member)
        return None

    def _served_by_pack(self, key: str) -> bool:
        return self._array_of(key) is not None

    @cached_property
    def _names(self) -> NamedKeys:
        """The keys the metadata names: the store presents those alone (a planted array is no member)."""
        return NamedKeys(self._meta)

    # Listing ----------------------------------------------------------------------------------------------
    async def list(self) -> AsyncIterator[str]:
        async for key in self._base.list():
            if not self._served_by_pack(key) and self._names.key(key):
                yield key
        async for key in self._virtual_keys(""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        path = prefix.strip("/")
        if not path:
            async for key in self.list():
                yield key
            return
        below = path + "/"
        if self._array_of(below) is not None:  # a packed array or a key inside one
            for key in await self._array_keys(self._array_of(below)):  # type: ignore[arg-type]
                if key.startswith(below):
                    yield key
            return
        async for key in self._base.list_prefix(below):
            if key.startswith(below) and not self._served_by_pack(key) and self._names.key(key):
                yield key
        async for key in self._virtual_keys(path):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        path = prefix.strip("/")
        below = path + "/" if path else ""
        name = self._array_of(below) if path else None
        seen: set[str] = set()
        if name is not None:  # inside a packed array: its pack's members
            for key in await self._array_keys(name):
                if key.startswith(below):
                    child = key[len(below) :].split("/", 1)[0]
                    if child not in seen:
                        seen.add(child)
                        yield child
            return
        async for child in self._base.list_dir(prefix):
            if child not in seen and (self._names.key(below + child) or self._names.directory(below + child)):
                seen.add(child)
                yield child
        for child in sorted(self._children.get(path, ())):
            if child not in seen:
                seen.add(child)
                yield child
        if path in self._group_pack and "zarr.json" not in seen and await self.exists(below + "zarr.json"):
            yield "zarr.json"

    async def _virtual_keys(self, path: str) -> AsyncIterator[str]:
        """Keys served from packs at or below the directory ``path`` ("" for all): packed arrays' members,
        and the group documents the checkpoint itself lacks."""
        below = path + "/" if path else ""
        for group in sorted(self._group_pack):
            if group == path or group.startswith(below):
                key = f"{group}/zarr.json" if group else "zarr.json"
                if not await self._base.exists(key) and await self._member(key) is not None:
                    yield key
        for name in sorted(self._packed):
            if self._meta.tensors[name].pack_rank is not None and name.startswith(below):
                for key in await self._array_keys(name):
                    yield key
        for pkey, names in sorted(self._in_pack.items()):
            wanted = [n for n in names if n.startswith(below)]
            if not wanted:
                continue
            pack = await self._pack(pkey)
            for key in pack.members:
                name = self._array_of(key)
                if name is not None and name.startswith(below) and self._packed[name] == pkey:
                    yield key

    async def _array_keys(self, name: str) -> list[str]:
        """The keys of the packed array ``name``: format 6, its ``zarr.json`` and every chunk of its grid (each
        has its member, checked when read); format 5, its pack's members."""
        t = self._meta.tensors[name]
        if t.pack_rank is None:
            pack = await self._pack(self._packed[name])
            return [k for k in pack.members if k.startswith(name + "/")]
        await self._capacity(name)  # the packs can hold the grid declared, before a key is built per chunk
        return [f"{name}/zarr.json"] + [
            f"{name}/{self._sep.join(['c', *map(str, index)])}" for index in _grid(t.shape, t.chunk_shape)
        ]

    def _rank_of(self, name: str, key: str) -> int | None:
        """Format 6: the rank whose packs hold ``key`` of the packed array ``name`` (its creator for its
        ``zarr.json``, a chunk's writer for the chunk), None for a key the array does not have."""
        t = self._meta.tensors[name]
        leaf = key[len(name) + 1 :]
        if leaf == "zarr.json":
            return t.pack_rank
        flat = _chunk_flat(leaf, t.shape, t.chunk_shape, self._sep)
        return None if flat is None else t.writers[flat]
