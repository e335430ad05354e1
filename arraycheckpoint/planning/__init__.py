"""The pure planning layer: N-D boxes and flat ranges (:mod:`.regions`), layout rules and meshes (:mod:`.rules`),
chunk grids (:mod:`.chunking`), chunk owners (:mod:`.owners`), packs of small chunk files (:mod:`.packing`),
the planner (:mod:`.plan`, :mod:`.groupplan`) and the framework-free items adapters hand the engine
(:mod:`.items`). Functions of their arguments only: no I/O, no collective, no framework. May import:
``errors``, ``codecs`` and ``checks``.
"""
