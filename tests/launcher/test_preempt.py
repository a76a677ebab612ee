"""Preemption requests: signals and the stop file are recorded, the grace timer ends the process
with the resumable exit code, a second Ctrl-C exits at once."""

import os
import signal
import time

from launcher.preempt import EXIT_PREEMPTED, StopRequest, stop_file_blocks_start


def test_sigterm_is_recorded_and_grace_exits_75(capfd):
    exits = []
    stop = StopRequest(grace_s=0.2, exit_fn=exits.append).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert stop.requested == "SIGTERM"
        time.sleep(0.4)
        assert exits == [EXIT_PREEMPTED]
    finally:
        stop.uninstall()
    err = capfd.readouterr().err
    assert "finishing the step and saving a checkpoint" in err and "grace of 0.2 s ran out" in err


def test_second_sigint_exits_at_once():
    exits = []
    # the handler uninstall must restore: Python's default, or SIG_IGN in a job started in the background
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest(grace_s=0, exit_fn=exits.append).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested == "SIGINT" and exits == []
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert exits == [130]
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_file(tmp_path):
    f = tmp_path / "stop"
    stop = StopRequest(grace_s=0, stop_file=str(f))
    stop.poll_file()
    assert stop.requested is None and not stop_file_blocks_start(str(f))
    f.touch()
    stop.poll_file()
    assert stop.requested == f"stop file {f}" and stop_file_blocks_start(str(f))
