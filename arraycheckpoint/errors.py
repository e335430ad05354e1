"""The one error hierarchy of arraycheckpoint.

Every error raised on purpose derives from :class:`ArrayCheckpointError`; leaves also inherit the builtin they
resemble so that ``except FileNotFoundError`` keeps working for callers who do not know this library.
Messages name the tensor, the rank and the fix.
"""

from __future__ import annotations

import pickle


class ArrayCheckpointError(Exception):
    """Root of every error raised by arraycheckpoint."""


class CheckpointNotFoundError(ArrayCheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the path (missing, or never committed)."""


class CheckpointExistsError(ArrayCheckpointError, FileExistsError):
    """A committed checkpoint (or a save in progress) already occupies the target path."""


class MetadataError(ArrayCheckpointError, ValueError):
    """The checkpoint metadata (``.acp/metadata.json``; ``.metadata.json`` before format 3) is malformed, of an unknown format version, or describes impossible tensors."""


class UnsafeNameError(ArrayCheckpointError, ValueError):
    """A tensor or object name would escape the checkpoint directory or clash with the format's own files."""


class StateMismatchError(ArrayCheckpointError, KeyError):
    """A strict load found missing keys, unexpected keys, or shape/dtype mismatches."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class PlanError(ArrayCheckpointError, ValueError):
    """The global save plan is invalid: a region out of bounds, overlapping regions, or a coverage hole."""


class CorruptCheckpointError(ArrayCheckpointError, OSError):
    """Stored bytes failed their checksum or could not be decoded."""


class PickleNotAllowedError(ArrayCheckpointError, TypeError):
    """A value needs pickle, which is refused unless ``allow_pickle=True`` is passed."""


class UnsupportedDTypeError(ArrayCheckpointError, TypeError):
    """A tensor's dtype has no Zarr v3 representation."""


class SaveFailedError(ArrayCheckpointError, RuntimeError):
    """A save failed on one or more ranks; the message names each failing rank and its error."""


class StorageError(ArrayCheckpointError, OSError):
    """A storage operation failed permanently (after retries where they apply)."""


class InvalidArgumentError(ArrayCheckpointError, TypeError, ValueError):
    """An argument of :func:`~arraycheckpoint.save` / :func:`~arraycheckpoint.load` is unknown or invalid."""


class InvalidStateError(ArrayCheckpointError, TypeError, ValueError):
    """The ``state`` mapping holds something that cannot be checkpointed as given (the message says the fix)."""


class MetaDeviceError(ArrayCheckpointError, RuntimeError):
    """The load target holds tensors on the meta device that the checkpoint cannot fill in place."""


class UnpicklingError(ArrayCheckpointError, pickle.UnpicklingError):
    """A pickled value (saved with ``allow_pickle=True``) could not be restored; the entry is named."""


class InconsistentCheckpointError(MetadataError, CorruptCheckpointError):
    """The stored files do not hold what ``.metadata.json`` declares (chunk files missing, or a declared
    shape the checkpoint cannot hold): damaged or hostile. Both a :class:`MetadataError` and a
    :class:`CorruptCheckpointError`, since from the files alone the two cannot be told apart."""


class StalledRankError(ArrayCheckpointError, TimeoutError):
    """A rank stopped making progress (no heartbeat, or no answer, within the liveness timeout) during a
    checkpoint collective; the message names the rank(s) and the timeout."""
