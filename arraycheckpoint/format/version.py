"""The library version: recorded in every checkpoint's metadata (``library_version``), printed by the CLI."""

__version__ = "0.1.0"
