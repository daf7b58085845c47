"""A worker that exits on a lost peer leaves a watcher (common.errors): a launcher that
does not reap the worker within LAUNCHER_STUCK_S is stuck (torchrun on a machine cut off
from the rendezvous host waits for TCP to give up, about 15 minutes) and is killed, with
one line; a launcher that reaps its worker is left alone. The real case, with torchrun on
two network hosts and a cut cable: test_two_hosts.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.errors import LAUNCHER_STUCK_S
from conftest import REPO

# A launcher process: it forks a worker that leaves its watcher and exits at once, then
# reaps it at once ("reaps") or never ("stuck"), and lives on for longer than the watcher waits.
LAUNCHER = f"""
import os, sys, time
from common.errors import stop_the_launcher_if_it_hangs
worker = os.fork()
if worker == 0:
    os.environ["LOCAL_RANK"] = "0"
    stop_the_launcher_if_it_hangs()
    os._exit(1)
if sys.argv[1] == "reaps":
    os.waitpid(worker, 0)
time.sleep({LAUNCHER_STUCK_S} + 5)
print("lived on", flush=True)
"""


@pytest.mark.waits
def test_a_launcher_that_does_not_reap_its_worker_is_killed_and_one_that_does_is_not():
    launchers = {how: subprocess.Popen([sys.executable, "-c", LAUNCHER, how], cwd=REPO, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for how in ("stuck", "reaps")}
    out = {how: (*p.communicate(timeout=120), p.returncode) for how, p in launchers.items()}
    stdout, stderr, status = out["stuck"]
    assert status == -9 and stdout == "", out
    [line] = stderr.strip().splitlines()
    assert line == (f"error: torchrun (pid {launchers['stuck'].pid}) did not notice its worker's exit for "
                    f"{LAUNCHER_STUCK_S:.0f} s: it waits on the lost machine's rendezvous (TCP gives up "
                    f"after about 15 minutes); stopped it"), line
    assert out["reaps"] == ("lived on\n", "", 0), out
