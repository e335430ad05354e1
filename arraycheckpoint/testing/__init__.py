"""Test suites shipped with the package, for backends and adapters written outside it.

:mod:`arraycheckpoint.testing.storage` holds the storage conformance suite: subclass
:class:`~arraycheckpoint.testing.storage.StorageTests` and supply a ``base_url`` fixture. Importing these
modules needs pytest; the package itself never imports them.
"""

from __future__ import annotations
