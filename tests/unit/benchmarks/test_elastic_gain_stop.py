"""A SIGTERM to the elastic-gain benchmark, once its Ray cluster is up, unwinds as Ctrl-C does: the launch in
progress (a child in a session of its own) is stopped through the `finally` that waits for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark_module

gain = load_benchmark_module("elastic_gain")


def test_a_sigterm_stops_the_launch_in_progress(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    # a launch handles SIGINT whatever it inherited (a background job's shell starts children with it ignored)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
                              "signal.SIG_DFL); time.sleep(120)"], start_new_session=True)
    try:
        gain.stop_on_sigterm()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            try:
                child.wait(timeout=60)
            finally:
                gain.stop_group(child, tmp_path / "run")
        assert child.returncode == -signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            child.kill()
            child.wait()
