"""The on-disk format: the checkpoint's metadata document and its parser (:mod:`.metadata`), per-rank documents
as templates plus rows (:mod:`.rankdoc`), per-rank arrays stacked by rank (:mod:`.perrank`), the zarr
hierarchy documents (:mod:`.hierarchy`), extra state as JSON plus arrays (:mod:`.extras`) and the library
version recorded in every checkpoint (:mod:`.version`). Pure: builds and parses documents, never reads or
writes a file. May import: ``errors``, ``codecs``, ``checks`` and ``planning``.
"""
