"""The suite's own launcher (tests/zygote.py), where the tests rely on it: the workers that
torchrun itself starts in a fork of the warm interpreter are forks of torchrun's process,
yet each is what `python -u script args` would have made: its own session, torchrun's
environment, only the standard streams open, the signals as a new interpreter sets them,
unbuffered output. fresh_workers=True starts new interpreters, which show the same."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run, torchrun_cmd

PROBE = """
import json, os, signal, sys
print(json.dumps({"rank": os.environ["RANK"], "run_id": os.environ["TORCHELASTIC_RUN_ID"],
                  "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
                  "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),  # listdir's own: 3
                  "argv": sys.argv, "cwd": os.getcwd(),
                  "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "unbuffered": sys.stdout.write_through and sys.stderr.write_through,
                  "torch_imported_before": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_torchruns_workers_are_what_python_u_script_makes(tmp_path, fresh):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = run(torchrun_cmd(2, script, "one arg"), warm=False, fresh_workers=fresh, timeout=120)
    seen = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda s: s["rank"])
    assert [s["rank"] for s in seen] == ["0", "1"], proc.stdout + proc.stderr
    agent = seen[0]["ppid"]
    for s in seen:
        assert s["ppid"] == agent and s["sid"] == s["pid"] != agent  # torchrun's child, a session of its own
        assert s["run_id"] == seen[0]["run_id"]
        assert s["fds"] == [0, 1, 2, 3]  # nothing of torchrun's (its store's sockets) left open
        assert s["argv"] == [str(script), "one arg"] and s["cwd"] == str(REPO)
        assert s["sigterm_default"] and s["sigint_raises"] and s["unbuffered"]
        assert s["torch_imported_before"] is not fresh  # the fork has it; a new interpreter does not
