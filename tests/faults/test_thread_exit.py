"""A process that ends while a point-to-point collective it gave up is still pending exits cleanly (no SIGABRT).

gloo's point-to-point works complete only through ``wait()``, so a helper thread (``acp-p2p-wait``) waits
inside gloo with the GIL released. When a peer stalls, the waiting rank raises ``StalledRankError`` and the
thread stays blocked; if the stalled peer's process then ends (the job is torn down) while this process
finalizes, the wait returns with an error, Python ends the thread from inside torch's C++ binding, and the
process aborts ("terminate called without an active exception") after the script itself returned.

Here rank 1 stops itself (SIGSTOP) after the checkpoint group exists; rank 0's fragment exchange
(``all_to_all_bytes``, the FSDP1 boundary exchange's collective) waits for bytes rank 1 never sends, fails with
``StalledRankError``, and the script catches it and ends. An object whose ``__del__`` runs during finalization
tells the test, which kills rank 1 then, so the connection closes while rank 0 finalizes: without the exit
hook that ends the abandoned wait first, every run aborts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

from dist import free_port

SCRIPT = textwrap.dedent(
    """
    import os
    import signal
    import sys
    import time

    import numpy as np
    import torch.distributed as dist

    from arraycheckpoint.errors import StalledRankError
    from arraycheckpoint.runtime.collectives import TorchCommunicator

    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    comm = TorchCommunicator(timeout=1.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, never sends: killed by the test while rank 0 finalizes
        sys.exit(3)


    class Finalizing:
        def __del__(self, write=os.write, sleep=time.sleep):
            write(1, b"finalizing\\n")  # module teardown: the interpreter is finalizing
            sleep(1.5)


    try:
        comm.all_to_all_bytes([np.empty(0, np.uint8)] * 2, [0, 8])  # 8 bytes from rank 1, never sent
        sys.exit(4)
    except StalledRankError:
        print("stalled", flush=True)
    keep = Finalizing()
    """
)


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def test_exit_with_an_abandoned_p2p_wait_does_not_abort(tmp_path) -> None:
    script = tmp_path / "exit_in_p2p_wait.py"
    script.write_text(SCRIPT)
    env = _env()
    init = (
        f"tcp://127.0.0.1:{free_port()}"  # the store's server in rank 0: it answers while rank 1 is stopped
    )
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (1, 0)
    ]
    peer, main = ranks
    guard = threading.Timer(120, lambda: [p.kill() for p in ranks])  # a hang fails the test, not the run
    guard.start()
    try:
        lines = [main.stdout.readline() for _ in range(2)]  # "stalled", then "finalizing" from __del__
        peer.kill()  # the stalled peer goes while rank 0 finalizes: its pending receive fails now
        out, err = main.communicate(timeout=120)
    finally:
        guard.cancel()
        for p in ranks:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.communicate()
    assert [s.strip() for s in lines] == ["stalled", "finalizing"], (lines, err[-2000:])
    assert main.returncode == 0, (main.returncode, err[-2000:])
    assert "terminate called" not in err, err[-2000:]


LOADER_SCRIPT = textwrap.dedent(
    """
    import os
    import time
    from dataclasses import dataclass
    from datetime import timedelta

    import torch.distributed as dist

    from arraycheckpoint.data.tokenbuffer import NumberedSource, TokenBufferLoader


    @dataclass(frozen=True)
    class NativeSource(NumberedSource):
        def read(self, index, i):
            try:  # 0.3 s inside a C++ library with the GIL released (a real source's file or network read)
                dist.HashStore().wait(["never"], timedelta(seconds=0.3))
            except Exception:
                pass
            return self.read_fast(index, i)


    class Finalizing:
        def __del__(self, write=os.write, sleep=time.sleep):
            write(1, b"finalizing\\n")
            sleep(1.0)


    loader = TokenBufferLoader([NativeSource("a", 10**6)], seq_len=4, max_ready_batches=10**6)
    next(loader)  # the script stops iterating early and never closes the loader: its reader reads on
    time.sleep(0.1)
    keep = Finalizing()
    print("done", flush=True)
    """
)


def test_exit_while_the_token_reader_is_in_a_native_read_does_not_abort(tmp_path) -> None:
    script = tmp_path / "exit_in_reader.py"
    script.write_text(LOADER_SCRIPT)
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env()
        )
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        assert "terminate called" not in run.stderr and run.stdout.split() == ["done", "finalizing"], run
