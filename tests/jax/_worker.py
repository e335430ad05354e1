"""Subprocess entry of :func:`jaxrun.run_jax`: initialise JAX, run one test body, write its JSON result."""

from __future__ import annotations

import importlib.util
import json
import os
import sys


def main() -> None:
    module_file, fn, args, out = sys.argv[1:5]
    import jax

    processes = int(os.environ.get("ACP_JAX_PROCESSES", "1"))
    if processes > 1:
        jax.distributed.initialize(
            coordinator_address=os.environ["ACP_JAX_COORDINATOR"],
            num_processes=processes,
            process_id=int(os.environ["ACP_JAX_PROCESS_ID"]),
        )
    here = os.path.dirname(os.path.abspath(module_file))
    sys.path[:0] = [here, os.path.dirname(here)]
    spec = importlib.util.spec_from_file_location("_acp_jax_body", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = getattr(module, fn)(*json.loads(args))
    with open(out, "w") as f:
        json.dump(result, f)
    if processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
