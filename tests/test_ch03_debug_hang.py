"""Chapter 03's hang debugging demo, on gloo: TORCH_DISTRIBUTED_DEBUG=DETAIL names a
mismatched collective on both ranks, and names the rank that never arrived once the
timeout fires; SIGUSR1 makes every rank print where it is, without stopping it. (The
plain timeout, without DETAIL, is chapter 05's test.)"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from conftest import REPO, run, start, torchrun_cmd
from procs import kill_job

SCRIPT = "03-ddp/debug_hang.py"
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


@pytest.mark.launch
@pytest.mark.waits
def test_detail_names_the_mismatched_collective_on_both_ranks():
    proc = run(torchrun_cmd(2, SCRIPT), env=DETAIL, check=False, timeout=120)
    out = proc.stdout
    assert proc.returncode != 0
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in out
    # rank 0 is in step 0's loss all-reduce (1 value), rank 1 already in step 1's
    # gradient all-reduce (1000 values): the same call number, different shapes
    for rank, step, mine, theirs in ((0, 0, 1, 1000), (1, 1, 1000, 1)):
        line = next((s for s in out.splitlines() if s.startswith(f"rank {rank} failed in step {step}: ")), None)
        assert line, out + proc.stderr
        assert "Detected mismatch between collectives on ranks" in line
        assert re.search(rf"Rank {rank} is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                         rf"OpType=ALLREDUCE, TensorShape=\[{mine}\]", line), line
        assert f"but Rank {1 - rank} is running collective" in line and f"TensorShape=[{theirs}]" in line
        assert f"Tensor shapes: {mine}vs {theirs}" in line


@pytest.mark.launch
@pytest.mark.waits
def test_a_hang_shows_every_stack_and_detail_names_the_missing_rank(tmp_path):
    timeout = 8
    cmd = torchrun_cmd(2, SCRIPT, "--failure", "hang", "--timeout", timeout)
    out_log, err_log = tmp_path / "stdout", tmp_path / "stderr"
    job = start(cmd, out_log, err_log=err_log, env=DETAIL)
    try:
        deadline = time.monotonic() + 120
        while "\nstep 2" not in out_log.read_text():  # rank 0's last step: it now waits for rank 1
            assert job.poll() is None and time.monotonic() < deadline, out_log.read_text()
            time.sleep(0.05)
        pids = [int(p) for p in re.findall(r"rank \d=(\d+)", out_log.read_text())]
        assert len(pids) == 2, out_log.read_text()
        time.sleep(1.5)  # rank 1 leaves its last step and sits in validate()
        t0 = time.perf_counter()
        for pid in pids:  # one after another: two dumps at once into one file would splice
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
        job.wait(timeout=120)
        waited = time.perf_counter() - t0
    finally:
        kill_job(job.pid)
    out, err = out_log.read_text(), err_log.read_text()
    assert job.returncode != 0
    # both ranks printed their stacks and went on: rank 0 inside the all-reduce of
    # train_step, rank 1 in validate
    stacks = err.split("Current thread ")[1:]
    assert len(stacks) == 2, err
    assert any("in all_reduce" in s and "in train_step" in s for s in stacks), err
    assert any("in validate" in s and "in train_step" not in s for s in stacks), err
    # then the timeout fired, and DETAIL's barrier before the collective names the rank
    # that never came
    assert f"rank 0 failed in step 2: [Rank 0]: Ranks 1 failed to pass monitoredBarrier in {timeout * 1000} ms" \
        in out, out + err
    assert waited < timeout + 60  # the timeout, with room for a busy machine


def test_the_stacks_quoted_in_the_readme_name_the_lines_of_the_script():
    """Each frame `function (debug_hang.py:N)` of the README's py-spy dumps is a line of
    that function in the script as it is now: an edit above it would shift the numbers."""
    script = (REPO / "03-ddp" / "debug_hang.py").read_text().splitlines()
    frames = re.findall(r"^ +(\w+) \(debug_hang\.py:(\d+)\)$", (REPO / "03-ddp" / "README.md").read_text(), re.M)
    assert len(frames) >= 4
    for function, line in frames:
        above = script[:int(line)]
        enclosing = next(text for text in reversed(above) if text.startswith("def "))
        assert enclosing.startswith(f"def {function}("), (function, line, enclosing)
        assert above[-1].strip() and not above[-1].lstrip().startswith(("#", "def ")), (function, line)
