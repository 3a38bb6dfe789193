"""`pid_alive`, which the launcher asks about every rank many times a second: a running process is alive; an
exited one its parent has not reaped (a zombie) and a reaped one are gone."""

import subprocess
import time
from pathlib import Path

from rollart_hpc.cluster.procs import pid_alive


def test_running_zombie_and_reaped_processes():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert pid_alive(proc.pid)
    finally:
        proc.kill()
    # Not reaped yet: a zombie, which counts as gone (kill's signal 0 still finds it).
    deadline = time.monotonic() + 60
    while Path(f"/proc/{proc.pid}/stat").read_bytes().rsplit(b")", 1)[1][1:2] != b"Z":
        assert time.monotonic() < deadline, "the killed process never became a zombie"
        time.sleep(0.01)
    assert not pid_alive(proc.pid)
    proc.wait()
    assert not pid_alive(proc.pid)
