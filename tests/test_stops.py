"""A run stopped from outside ends with one true line: a terminal's Ctrl-C, a signal
sent to a DataLoader worker alone, a rank whose peer stopped first. Each case runs in a
process of its own (tests/stop_cases.py), all of them in one launch."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from conftest import REPO, run

INTERRUPTED = "\ninterrupted (Ctrl-C): stopped where it was; what it logged so far stays, nothing else was saved\n"


@pytest.mark.launch
def test_a_stop_from_outside_ends_with_one_true_line(tmp_path):
    cases = ["ctrl-c-race", "worker-sigint", "unreaped-worker-signal", "peer-then-ctrl-c", "peer-failed"]
    ended = json.loads(run([sys.executable, REPO / "tests" / "stop_cases.py", tmp_path, *cases],
                           timeout=240).stdout)
    # Ctrl-C's SIGINT and the SIGCHLD of the worker it ended, handled by Python one after
    # the other: the second found its handler already switched to SIG_DFL, and Python
    # printed "OSError: Signal 17 ignored due to race condition" with a traceback
    assert ended["ctrl-c-race"] == {"status": 130, "stderr": INTERRUPTED}
    # SIGINT sent to the worker alone was blamed on the out-of-memory killer (status 1)
    assert ended["worker-sigint"] == {"status": 130, "stderr": INTERRUPTED}
    # a worker whose death broke the pipe first is named by the signal that ended it
    assert ended["unreaped-worker-signal"] == {"status": 0, "stderr": (
        f"{int(signal.SIGTERM)}: SIGTERM, a stop signal, reached the worker itself (a job scheduler "
        f"or `kill`): not a lack of memory\n")}
    # a rank whose peer stopped first, its own Ctrl-C a moment later: interrupted, not
    # "a peer closed its connection: another rank failed first"
    assert ended["peer-then-ctrl-c"] == {"status": 130, "stderr": INTERRUPTED}
    failed = ended["peer-failed"]  # no signal: the peer did fail
    assert failed["status"] == 1 and failed["stderr"].count("\n") == 1
    assert failed["stderr"].startswith("error: rank 0: a peer closed its connection: another rank failed first")
