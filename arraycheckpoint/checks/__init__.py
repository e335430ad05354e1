"""Checks of untrusted values, the lowest layer above the errors: bounded JSON and the limits of what a valid
checkpoint can hold (:mod:`.bounds`), declared array layouts (:mod:`.limits`), entry names (:mod:`.names`),
local files opened without following links (:mod:`.files`), ZIP central directories of packs (:mod:`.zipdir`)
and zstd frame headers (:mod:`.zstd`). Each takes bytes, numbers or names and refuses what a valid checkpoint
cannot hold, naming it; none knows the metadata's types. May import: ``arraycheckpoint.errors`` and
``arraycheckpoint.codecs`` only (the checks of a stored checkpoint against its metadata are
:mod:`arraycheckpoint.audit`).
"""
