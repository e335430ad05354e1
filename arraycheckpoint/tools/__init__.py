"""The logic behind the ``arraycheckpoint`` console command, importable without the CLI.

Each module does one job and returns plain data (dataclasses, dicts) that the CLI prints:

* :mod:`.common`: open a committed checkpoint and read whole tensors or row blocks through the engine;
* :mod:`.inspect`: a summary of tensors, sharding at save time, topology and totals;
* :mod:`.verify`: commit marker, region coverage, chunk presence and checksums of every stored chunk;
* :mod:`.export`: Hugging Face-style sharded safetensors (or one ``torch.save`` file), memory bounded by the
  output shard size;
* :mod:`.importer`: safetensors files / HF directories, ``torch.save`` state dicts and torch DCP directories;
* :mod:`.rename`: in-place key renames (directory renames, or packs rewritten with renamed members by
  :mod:`.repack`, plus a metadata rewrite; local file systems only);
* :mod:`.diff`: per-tensor equality and max abs difference of two checkpoints of any layouts;
* :mod:`.metrics`: per-rank phase tables, heat-map and timeline plots.

Every byte of tensor data is read through :func:`arraycheckpoint.engine.engine`; nothing here opens arrays by
another path (verify only lists keys, and reads packs' ZIP directories, to find stored chunks that are missing;
rename copies pack members' bytes into the renamed pack without decoding them).

Layer ``tools``: above the public API; may import every layer but ``cli`` and ``testing``.
"""

from __future__ import annotations
