"""Checks of a stored checkpoint against its metadata, run before the engine reads anything the checkpoint
declares (DESIGN invariant 10): directory scans of the arrays read (:mod:`.scan`), every array's ``zarr.json``
and zstd frames (:mod:`.arrays`), packs' ZIP directories read through the storage (:mod:`.packdir`) and their
members (:mod:`.packs` for format 5, :mod:`.rankpacks` for format 6). May import every layer below it,
``errors`` up to ``storage`` (it uses no adapter).
"""
