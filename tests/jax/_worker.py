"""Subprocess entry of :func:`jaxrun.run_jax`: initialise JAX, run one test body, write its JSON result; with
``--serve ACK_FD``, run bodies read from stdin (one JSON line each: module file, function, arguments, result
file) one after another, answering ``ok`` or ``error`` on ``ACK_FD`` after each, until stdin closes or a
body raises."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from typing import Any


def _load(module_file: str, name: str) -> Any:
    here = os.path.dirname(os.path.abspath(module_file))
    sys.path[:0] = [here, os.path.dirname(here)]
    spec = importlib.util.spec_from_file_location(name, module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    result = getattr(_load(module_file, "_acp_jax_body"), fn)(*json.loads(args))
    with open(out, "w") as f:
        json.dump(result, f)
    if processes > 1:
        jax.distributed.shutdown()


def serve(ack_fd: int) -> None:
    import jax  # noqa: F401 - the devices are fixed here, before any body

    modules: dict[str, Any] = {}
    for line in sys.stdin:
        module_file, fn, args, out = json.loads(line)
        try:
            if module_file not in modules:
                modules[module_file] = _load(module_file, f"_acp_jax_body{len(modules)}")
            result = getattr(modules[module_file], fn)(*args)
            with open(out, "w") as f:
                json.dump(result, f)
            status = "ok"
        except BaseException:  # noqa: BLE001 - reported, then this interpreter retires
            traceback.print_exc()
            status = "error"
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(ack_fd, f"{status}\n".encode())
        if status != "ok":
            return


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
    else:
        main()
