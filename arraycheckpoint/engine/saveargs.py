"""Save arguments and global values every rank must share, checked inside the fixed-size agreement.

:meth:`~arraycheckpoint.engine.coordinate.Coordinator.agree` all-reduces two more digest pairs: one of this
rank's save arguments (:func:`save_arguments`) and one of its global objects (stored from rank 0 only). All
ranks then know, identically, whether anything differs; only then do they run the collectives here (a gather
to the coordinator and a broadcast), so a save whose arguments agree pays nothing more.

* differing arguments (``plan_options``, ``compression``, ``overwrite``, ``timeout``, ``step``) fail the save on
  every rank before anything is written, naming the argument and which ranks hold which value. Planned with
  each rank's own options, such a save used to hang (2 ranks) or abort inside gloo (3 ranks);
* a differing global object (a non-tensor ``extra_state`` value) warns, naming it and the ranks: only rank
  0's value is stored. A rank that reports no global object (megatron reports them from rank 0 only) agrees
  with any.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import warnings

from .job import SaveJob

log = logging.getLogger("arraycheckpoint")


def save_arguments(job: SaveJob) -> dict[str, str]:
    """The save arguments that must be equal on every rank, as comparable text (argument name -> repr)."""
    plan = job.options.plan
    return {
        "plan_options": repr(dataclasses.replace(plan, compression=None)),
        "compression": repr(plan.compression),
        "overwrite": repr(job.options.overwrite),
        "timeout": repr(job.options.liveness_timeout),
        "step": repr(job.request.step),
    }


def _objects(job: SaveJob) -> dict[str, str]:
    """Digest (hex) of each global object's value: what rank 0 stores for every rank. Only the user's values
    (``extra_state`` and the like): an adapter's own entries (``~param_groups``, megatron's ``~common``,
    reported by rank 0 only) are left out."""
    out = {}
    for o in job.request.objects:
        if o.scope == "global" and "~" not in o.name:
            text = json.dumps(o.value, sort_keys=True, default=repr, separators=(",", ":"))
            out[o.name] = hashlib.sha1(text.encode()).hexdigest()[:16]
    return out


def _as_int(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 2  # negatable int64


#: What a rank that reports no global object sends for their digest: above every digest, so it agrees with
#: anything (megatron reports its global values from rank 0 only)
_NO_OPINION = 1 << 62


def agreement_values(job: SaveJob) -> list[int]:
    """``[a, -a, g, -g]``: digests of the save arguments and of the global objects, for the all-reduce-min."""
    a = _as_int(json.dumps(save_arguments(job), sort_keys=True))
    objects = _objects(job)
    if not objects:
        return [a, -a, _NO_OPINION, _NO_OPINION]
    g = _as_int(json.dumps(objects, sort_keys=True))
    return [a, -a, g, -g]


def check_agreement(job: SaveJob, agreed: list[int]) -> None:
    """Act on the all-reduced ``[a_min, -a_max, g_min, -g_max]`` (the same on every rank, so every rank runs
    the same collectives): differing arguments set ``job.mode = "skip"`` and the same error on every rank;
    differing global objects warn on the coordinator."""
    amin, amax_neg, gmin, gmax_neg = agreed
    if amin != -amax_neg:
        job.error = _differences(job, save_arguments(job), "save arguments")
        job.mode = "skip"
    if gmin != _NO_OPINION and gmin != -gmax_neg:
        message = _differences(job, _objects(job), "objects")
        if job.comm.rank == 0:
            warnings.warn(message, UserWarning, stacklevel=2)
            log.warning("%s", message)


def _differences(job: SaveJob, mine: dict[str, str], what: str) -> str:
    """Every rank's ``mine`` gathered on the coordinator, which describes the differing entries; the text is
    broadcast, so every rank holds the same message."""
    comm = job.comm
    gathered = comm.gather_json(mine, dst=0)
    text = ""
    if comm.rank == 0:
        assert gathered is not None
        lines = []
        for name in sorted(set().union(*gathered)):
            by_value: dict[str, list[int]] = {}
            for rank, values in enumerate(gathered):
                if name in values or what == "save arguments":  # a rank without global objects agrees
                    by_value.setdefault(values.get(name, "(absent)"), []).append(rank)
            if len(by_value) > 1:
                groups = sorted(by_value.items(), key=lambda kv: kv[1][0])
                lines.append(f"{name}: " + "; ".join(f"{v} on {_ranks(r)}" for v, r in groups))
        if what == "save arguments":
            text = (
                f"save arguments differ between ranks: {' | '.join(lines)}. Pass the same arguments on every "
                "rank (nothing was written)"
            )
        else:
            text = (
                f"global values differ between ranks and only rank 0's is stored: {' | '.join(lines)} "
                "(values by digest). Save per-rank values with arraycheckpoint.PerRank, or make them equal"
            )
    return str(comm.broadcast_json(text, src=0))


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1, 2`` (the first 8, then a count)."""
    head = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {head}" if len(ranks) == 1 else f"ranks {head}"
