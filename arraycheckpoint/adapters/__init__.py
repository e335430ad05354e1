"""Framework adapters. Each translates framework objects to the engine's items and back; none does I/O.

Layer ``adapters`` (with ``arraycheckpoint.data``): above ``runtime``, below ``storage``. May import
``errors``, ``codecs``, ``checks``, ``planning``, ``format`` and ``runtime``; frameworks only lazily. Two lazy
exceptions are listed in tests/test_layers.py.
"""
