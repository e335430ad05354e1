"""The runtime a save and a load run on: the Communicator seam over torch.distributed or JAX
(:mod:`.collectives`), stalled-rank detection (:mod:`.liveness`), reusable pinned host buffers
(:mod:`.hostpool`), per-phase timings (:mod:`.monitoring`), the two-phase future of an asynchronous save
(:mod:`.future`) and the process-wide tensorstore context (:mod:`.tscontext`). Knows nothing of the format's
contents. May import: ``errors``, ``codecs``, ``checks``, ``planning`` and ``format``.
"""
