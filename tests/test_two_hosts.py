"""Chapters 03 and 04 on two real network hosts: Linux network namespaces joined by a
veth pair (tools.two_hosts), each with its own cache and save folder, no shared
filesystem. A cut cable ends every process of chapter 04 on both hosts soon after
--timeout, with one line, and the rerun resumes exactly from node-local checkpoints, as
one machine trains; the default network settings that cannot work across machines are
one line naming the fix. (Two launchers of two processes each, meeting through a c10d
rendezvous on one machine: test_ch03_ddp.py.)
Needs root and iproute2 (CI has both); skipped with the reason otherwise."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# (teardown under another name: pytest before 8 calls a module-level `teardown(module)`
# after the module's last test, nose-style)
from tools.two_hosts import HostError, create_hosts, cut_link, host_pids, in_host, restore_link, \
    teardown as remove_hosts, torchrun_argv
from ch04_runs import FREQ, NAME, THREADS, assert_same_as_uninterrupted, flags as ch04_flags
from conftest import TINY, start

CH03, CH04 = "03-ddp/train_llm.py", "04-checkpointing/train_llm.py"
TIMEOUT = 8            # --timeout in the cable test (seconds; short, yet safe on a busy CI machine)
MARGIN = 60            # seconds after --timeout by which every process must have ended
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ports = itertools.count(29400)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, guide_cache):
    """Two hosts, each with its own copy of the session's tokenizer cache (as a reader
    would copy it, or let each machine build its own)."""
    workdir = tmp_path_factory.mktemp("two-hosts")
    try:
        h = create_hosts(workdir, prefix=f"t{os.getpid() % 100000}", subnet="10.77.0.0/24")
    except HostError as e:
        pytest.skip(f"cannot build two network hosts here: {e}")
    try:
        probe = in_host(h, 0, [sys.executable, "-c", "pass"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
        if probe.wait(timeout=60) != 0:
            pytest.skip(f"cannot run a command inside a network namespace: {probe.stdout.read().strip()}")
        for i in range(2):
            shutil.copytree(guide_cache, h.cache(i), dirs_exist_ok=True)
        yield h
    finally:
        remove_hosts(h)
        assert not any(host_pids(n) for n in h.names)


def start_both(hosts, script, args, *, nproc=1, env=None, local_addrs=None, tag="run"):
    """Each host's torchrun, as a reader types it on two machines, with what
    tools.two_hosts.in_host gives it (the host's namespace, its cache, the repository as
    the folder): the real torchrun under `ip netns exec` (conftest.start); output into a
    log file per host. Returns (jobs, log paths)."""
    port, procs, logs = next(ports), [], []
    for i in range(2):
        argv = torchrun_argv(hosts, i, script, list(map(str, args)), port=port,
                             nproc_per_node=nproc, rdzv_id=f"{tag}-{port}", torchrun=TORCHRUN)
        if local_addrs:  # another --local-addr, or None: none at all
            argv = [(f"--local-addr={local_addrs[i]}" if local_addrs[i] else None)
                    if a.startswith("--local-addr=") else a for a in argv]
            argv = [a for a in argv if a is not None]
        log = hosts.dirs[i] / f"{tag}-{port}.log"
        procs.append(start(argv, log, netns=hosts.names[i], env={
            "LLM_GUIDE_CACHE": str(hosts.cache(i)), "GLOO_SOCKET_IFNAME": hosts.ifname, **(env or {})}))
        logs.append(log)
    return procs, logs


def wait_both(procs, logs, timeout=240):
    deadline = time.monotonic() + timeout
    statuses = []
    for p in procs:
        try:
            statuses.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            statuses.append(None)
    texts = [log.read_text() for log in logs]
    return statuses, texts


def run_both(hosts, script, args, **kw):
    procs, logs = start_both(hosts, script, args, **kw)
    statuses, texts = wait_both(procs, logs)
    return statuses, texts


def show(texts):
    return "\n".join(f"--- host{i + 1}\n{t[-5000:]}" for i, t in enumerate(texts))


def steps_logged(metrics):
    return metrics.read_text().count("\n") if metrics.exists() else 0


def wait_for_step(metrics, step, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while steps_logged(metrics) < step:
        assert all(p.poll() is None for p in procs), "the job ended before the interruption"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.02)


# ---- (a), (b) chapter 04 across two hosts with node-local checkpoints -------------------

@pytest.mark.launch
@pytest.mark.waits
def test_ch04_on_two_hosts_cut_cable_then_resume_exactly(hosts, uninterrupted):
    """(a) The cable is cut mid-training: every process on both hosts ends by itself soon
    after --timeout, the workers with one line each; the torchrun cut off from the
    rendezvous host, whose question to it would wait for TCP to give up (about 15
    minutes), is stopped by the watcher its worker left (common.errors). Nothing is
    signalled by the test. (b) After the cable is back, the rerun resumes from the
    checkpoint rank 0 (host 1) wrote and reads; host 2 receives it over the process group
    and never holds a checkpoint on its own disk. It finishes with exactly the losses and
    weights of chapter 04's uninterrupted run on one machine, 2 processes, the same global
    batch (conftest's `uninterrupted`). (A SIGKILL of every process, then the rerun:
    test_ch04_checkpointing.py, on one machine.)"""
    args = ch04_flags(None, "--timeout", TIMEOUT)  # chapter 04's test settings (tests/ch04_runs.py)
    ckpt1, ckpt2 = hosts.save_dir(0) / NAME / "checkpoints", hosts.save_dir(1) / NAME / "checkpoints"
    metrics = hosts.save_dir(0) / NAME / "metrics.jsonl"

    # (a) the cut cable
    procs, logs = start_both(hosts, CH04, args, tag="cut", env=THREADS)
    wait_for_step(metrics, FREQ + 2, procs)
    cut_link(hosts)
    t_cut = time.monotonic()
    said, gone = [None, None], None  # when each host's worker said its line; when all had ended
    while gone is None and time.monotonic() - t_cut < TIMEOUT + MARGIN:
        for i, log in enumerate(logs):
            if said[i] is None and "a peer stopped answering" in Path(log).read_text(errors="replace"):
                said[i] = time.monotonic() - t_cut
        if not any(host_pids(n) for n in hosts.names):
            gone = time.monotonic() - t_cut
        time.sleep(0.1)
    left = {n: host_pids(n) for n in hosts.names}
    for p in procs:  # cleanup before the verdict
        if p.poll() is None:
            p.kill()
    statuses, texts = wait_both(procs, logs, timeout=30)
    restore_link(hosts)
    print(show(texts))  # whole, under "Captured stdout" if an assert below fails (its message is cut short)
    print(f"\ncable cut after step {steps_logged(metrics)}, --timeout {TIMEOUT}: the workers said "
          f"their line after {said} s; every process had ended after {gone} s")
    assert gone is not None, f"still running {TIMEOUT + MARGIN} s after the cut: {left}\n{show(texts)}"
    assert None not in said, show(texts)
    for text in texts:
        lines = [line for line in text.splitlines() if "a peer stopped answering" in line]
        assert len(lines) == 1 and lines[0].startswith("error: rank "), show(texts)
        assert "Traceback" not in text.split(lines[0])[0]  # the worker printed no traceback
    # the cut came after step FREQ + 2 was logged; a busy machine may have trained (and
    # saved) a little further before the link went down
    latest = (ckpt1 / "latest").read_text()
    assert latest >= f"step-{FREQ:08d}" and (ckpt1 / latest / "state.pt").is_file()
    assert not ckpt2.exists()  # rank 0 wrote the checkpoint, on host 1's disk only

    # (b) cable back: the rerun resumes, and finishes exactly as uninterrupted
    statuses, texts = run_both(hosts, CH04, args, tag="rerun", env=THREADS)
    assert statuses == [0, 0], show(texts)
    assert f"resumed from {ckpt1 / latest}" in texts[0], show(texts)
    assert not ckpt2.exists()
    assert_same_as_uninterrupted(hosts.save_dir(0) / NAME, uninterrupted[1])


@pytest.mark.launch
@pytest.mark.waits
def test_ch04_a_frozen_host_ends_the_rendezvous_host_within_the_timeout(hosts):
    """Every process of host 2 stopped mid-training (SIGSTOP: a machine that hangs with its
    network up, its kernel still answering TCP): host 1, which holds the rendezvous, ends
    every one of its processes, torchrun included, soon after --timeout, its worker with
    one line. (Host 2 is a lost cause: the test kills it afterwards.)"""
    args = [*TINY, "--max-steps", 1000, "--ckpt-freq", 0, "--experiment-name", "frozen",
            "--timeout", TIMEOUT]
    metrics = hosts.save_dir(0) / "frozen" / "metrics.jsonl"
    procs, logs = start_both(hosts, CH04, args, tag="frozen", env=THREADS)
    try:
        wait_for_step(metrics, 2, procs)
        frozen = host_pids(hosts.names[1])
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t_stop, gone = time.monotonic(), None
        while gone is None and time.monotonic() - t_stop < TIMEOUT + MARGIN:
            if not host_pids(hosts.names[0]):
                gone = time.monotonic() - t_stop
            time.sleep(0.1)
        left = host_pids(hosts.names[0])
    finally:
        for pid in host_pids(hosts.names[0]) + host_pids(hosts.names[1]):  # SIGKILL ends a stopped process too
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        statuses, texts = wait_both(procs, logs, timeout=30)
    print(f"\nhost 2 stopped; every process of host 1 had ended after {gone} s (--timeout {TIMEOUT})")
    assert gone is not None, f"host 1 still running {TIMEOUT + MARGIN} s after host 2 froze: {left}\n{show(texts)}"
    errors = [line for line in texts[0].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "a peer stopped answering" in errors[0], show(texts)
    assert 'train_llm.py", line' not in texts[0], show(texts)


# ---- (c) a wrong interface or address: every process ends on its own, one line each ----

@pytest.mark.launch
@pytest.mark.waits
def test_a_wrong_interface_or_address_ends_on_its_own_with_one_line_each(hosts):
    """The two settings a reader gets by default on two machines: GLOO_SOCKET_IFNAME unset
    (gloo then advertises the host name's address: here the loopback), and torchrun without
    --local-addr (rank 0's host advertises its name, the loopback on the other host). The
    ranks cannot reach each other: a rank says in one line that a peer stopped answering
    (03-ddp/README.md's table names the fix), and the other machine's torchrun then loses
    its rendezvous (its own report). A rank that dials its peer gives up after --timeout;
    one that waits for its peer to dial in waits five times --timeout (gloo's rule for the
    first connection; with --timeout 8 on a busy machine it ended after 42 s), as the
    table says. Nothing waits longer, no script prints a traceback. The jobs run at once,
    with a shorter --timeout than the other tests: here nothing has to work before it
    expires."""
    timeout = 3
    cases = {"unset": ({"GLOO_SOCKET_IFNAME": ""}, None), "no-local-addr": ({}, [None, None])}
    jobs = {case: start_both(hosts, CH03, [*TINY, "--max-steps", 2, "--experiment-name", case,
                                           "--timeout", timeout], env=env, local_addrs=addrs, tag=case)
            for case, (env, addrs) in cases.items()}
    t0 = time.monotonic()  # every torchrun has started
    for case, (procs, logs) in jobs.items():
        statuses, texts = wait_both(procs, logs, timeout=5 * timeout + MARGIN)
        assert all(s not in (0, None) for s in statuses), show(texts)
        errors = [[line for line in text.splitlines() if line.startswith("error: ")] for text in texts]
        assert all(len(e) <= 1 for e in errors), show(texts)
        assert any(e and "a peer stopped answering" in e[0] for e in errors), show(texts)
        assert not any('train_llm.py", line' in text for text in texts), show(texts)  # no script traceback
    assert time.monotonic() - t0 < 5 * timeout + MARGIN


@pytest.mark.launch
def test_each_host_resolves_its_own_name_only(hosts):
    """Host names as on machines without DNS for each other (each one's /etc/hosts): the
    setting of the README's row "MASTER_ADDR=node1 ... does not resolve on this machine"."""
    def resolve(i, name):
        p = in_host(hosts, i, ["getent", "hosts", name], stdout=subprocess.PIPE, text=True)
        return p.communicate(timeout=30)[0].split(), p.returncode
    for i in range(2):
        assert resolve(i, hosts.names[i]) == ([hosts.addrs[i], hosts.names[i]], 0)
        assert resolve(1 - i, hosts.names[i])[1] != 0


# ---- the command line: bad input is one line and exit status 2 --------------------------

@pytest.mark.parametrize("argv, geteuid, message", [
    (["03-ddp/train_llm.py"], 1000, "error: creating network namespaces needs root (run with sudo)"),
    (["--subnet", "10.77.0.0/31", "03-ddp/train_llm.py"], 0,
     "error: --subnet 10.77.0.0/31: too small for two hosts (use /30 or larger)"),
    (["no-such-script.py"], 0, "error: 'no-such-script.py' is not a script under"),
], ids=["not-root", "small-subnet", "no-script"])
def test_two_hosts_command_refuses_bad_input_in_one_line(monkeypatch, capsys, argv, geteuid, message):
    from tools import two_hosts
    monkeypatch.setattr(two_hosts.os, "geteuid", lambda: geteuid)
    monkeypatch.setattr(two_hosts.shutil, "which", lambda name: f"/usr/sbin/{name}")
    with pytest.raises(SystemExit) as exit_info:
        two_hosts.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(message), err


def test_a_bad_prefix_or_workdir_is_refused_before_any_namespace(monkeypatch, capsys, tmp_path):
    """`--prefix "a b"` and a --workdir that is a file: one line, exit status 2, and not
    one `ip` command run (no namespace to leak), from the command and from create_hosts."""
    from tools import two_hosts
    monkeypatch.setattr(two_hosts.os, "geteuid", lambda: 0)
    monkeypatch.setattr(two_hosts.shutil, "which", lambda name: f"/usr/sbin/{name}")
    ip_calls = []
    monkeypatch.setattr(two_hosts, "_ip", lambda *args: ip_calls.append(args))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, message in ((["--prefix", "a b", "03-ddp/train_llm.py"], "--prefix 'a b': use only"),
                          (["--prefix", "a/b", "--teardown"], "--prefix 'a/b': use only"),
                          (["--workdir", str(a_file), "03-ddp/train_llm.py"], "is not a folder")):
        with pytest.raises(SystemExit) as exit_info:
            two_hosts.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    for kwargs, message in (({"prefix": "a b"}, "use only"), ({}, "cannot create")):
        with pytest.raises(two_hosts.HostError, match=message):
            two_hosts.create_hosts(a_file / "sub", **kwargs)
    assert ip_calls == []
