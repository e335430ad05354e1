"""A process that ends while its heartbeat thread is inside a c10d store call exits cleanly (no SIGABRT).

Python ends a daemon thread that comes back from a GIL-releasing call during interpreter finalization from
inside torch's C++ binding, and the process aborts ("terminate called without an active exception") after the
program succeeded: seen once in 15 runs of a 3-rank FSDP2 load (issue 22, item 6). The heartbeat spends a store
round trip per interval in such a call. Here the round trip is made long (a real ``HashStore.wait`` of 0.3 s
inside ``set``) and finalization slow (an object whose ``__del__`` sleeps), so the thread is certainly inside
the call when the interpreter exits and comes back while it finalizes: without the exit hook that stops the
heartbeat first, every run aborts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from arraycheckpoint.runtime.liveness import Liveness


    class SlowStore:
        def __init__(self, store):
            self.store, self.slow = store, False

        def set(self, key, value):
            if self.slow:  # 0.3 s inside c10d with the GIL released
                try:
                    self.store.wait(["never"], timedelta(seconds=0.3))
                except Exception:
                    pass
            self.store.set(key, value)

        def __getattr__(self, name):
            return getattr(self.store, name)


    class SlowFinalization:
        def __del__(self, sleep=time.sleep):
            sleep(1.0)  # runs while the interpreter finalizes (module teardown)


    store = SlowStore(dist.HashStore())
    live = Liveness(store, "t", rank=0, world=1, timeout=1.0)  # a beat every 0.05 s
    store.slow = True
    time.sleep(0.1)  # the heartbeat thread is inside a slow set now
    keep = SlowFinalization()
    print("done", flush=True)
    """
)


def test_exit_during_a_heartbeat_store_call_does_not_abort(tmp_path) -> None:
    script = tmp_path / "exit_in_heartbeat.py"
    script.write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
        )
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        assert run.stdout.strip() == "done" and "terminate called" not in run.stderr
