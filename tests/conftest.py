"""Shared test helpers: one tokenizer/corpus cache per test session, and runners for
the chapter scripts as a user would launch them (python or torchrun, as subprocesses)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# The suite runs several jobs on few cores. An OpenMP thread that finished its part of an
# op spins waiting for the next (GNU OpenMP's default, read when torch loads it), taking
# a core another job needs: the tests with two threads per rank cost twice the CPU.
# Waiting asleep changes no result; every process of the suite inherits this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from pages import readme_command  # noqa: E402
import warm  # noqa: E402
from warm import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Small settings every chapter smoke test uses.
TINY = ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4",
        "--log-freq", "1", "--val-batches", "2", "--warmup-steps", "2", "--num-workers", "0"]


def pytest_collection_modifyitems(items):
    """The order the tests start in (otherwise file order). A `long` test that started
    last would run on while the other workers have nothing left to do, so the long tests
    start first, and the short ones fill the cores around them. Under pytest-xdist's
    worksteal, worker k is first handed the k-th of W equal slices of this order (it
    steals from the others once its own slice is done); so each slice opens with its
    share of the long tests, and the first slice with the ones that mostly `wait` (for a
    timeout, a cut cable): those sleep while the other workers' first tests, several
    ranks each, keep the cores busy. Any other split still starts the long tests early."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    waiting = [i for i in items if i.get_closest_marker("waits")]
    long = [i for i in items if i.get_closest_marker("long") and i not in waiting]
    short = [i for i in items if not i.get_closest_marker("long") and i not in waiting]
    slices = [[] for _ in range(workers)]
    slices[0] += waiting
    for n, item in enumerate(long):  # dealt from the second slice on: beside the waiting
        slices[(n + 1) % workers].append(item)
    left = len(items)
    for k, chunk in enumerate(slices):  # the slice sizes worksteal hands out
        size = left // (workers - k)
        left -= size
        take = max(0, size - len(chunk))
        chunk += short[:take]
        del short[:take]
    items[:] = [item for chunk in slices for item in chunk] + short


@pytest.fixture(autouse=True)
def _no_logging_into_a_closed_stream():
    """A chapter's main() run in this process sets up logging onto the test's captured
    stdout (logging.basicConfig(force=True)); once the test ends, that stream is closed,
    and a later test's warning would print "Logging error" tracebacks. Such a handler
    goes with its test."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


def made_once(tmp_path_factory, name: str, make):
    """A session fixture's value, made once for the whole test run. Under pytest-xdist
    (`-n`) every worker is a session of its own: the first worker that asks makes it,
    under a lock, in a folder all workers share; the others wait, then read it. `make`
    gets that folder and returns something JSON can hold."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder; each worker's basetemp is inside it
    folder, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session", autouse=True)
def guide_cache(tmp_path_factory):
    """Every test and every subprocess shares one cache, filled once here, so runs
    that start together never race to train the same tokenizer. A test session that a
    test started (the GPU suite's rehearsal) takes over its parent session's cache."""
    from common.data import build_datasets
    os.environ.pop("LLM_GUIDE_PROGRESS", None)  # no bars, as in a log file, unless a test asks

    def fill(cache):
        build_datasets("stdlib", seq_len=64, cache_dir=cache)
        return str(cache)
    parents = os.environ.get("LLM_GUIDE_CACHE", "")
    if Path(parents).name == "llm-guide-cache" and Path(f"{parents}.json").is_file():
        cache = Path(parents)  # made_once's folder beside its record: an enclosing session filled it
    else:
        cache = Path(made_once(tmp_path_factory, "llm-guide-cache", fill))
    os.environ["LLM_GUIDE_CACHE"] = str(cache)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    share_the_cores_among_workers()
    return cache


def share_the_cores_among_workers():
    """Under pytest-xdist, W workers each run a test at once: each test's processes, and
    the worker itself, get the worker's share of the cores as CPU threads per process
    (cores // W, through LLM_GUIDE_THREADS, which every chapter's share_cpu_threads
    honours), not the whole machine each. Intra-op threads that outnumber the free cores
    only wait on each other: on 2 cores that cost the suite about 60 s of CPU. A serial
    run (no xdist), or LLM_GUIDE_THREADS set by the user, leaves the threads alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1 and not os.environ.get("LLM_GUIDE_THREADS"):
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["LLM_GUIDE_THREADS"] = str(threads)
        import torch
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_progress_bars_unless_asked():
    """Every test starts as in a log file: no LLM_GUIDE_PROGRESS, whatever an earlier test
    in this worker left (datasets' map with num_proc replaces os.environ with a copy,
    out of monkeypatch's reach)."""
    os.environ.pop("LLM_GUIDE_PROGRESS", None)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank inside the test (one CPU thread): the scripts'
    functions without the cost of starting torchrun and its workers. Yields the Group
    that `common.demos.start_group` would return."""
    import torch
    import torch.distributed as dist
    from common.demos import Group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    yield Group(0, 1, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


__all__ = ["free_port"]  # the tests import it from here
LAUNCHING = []  # whether the running test is marked `launch` (the full tier)


@pytest.fixture(autouse=True)
def _tier(request):
    """Only a test marked `launch` starts real launchers and fresh interpreters (`run`,
    `start`): the quick tier (-m "not launch") runs none."""
    LAUNCHING[:] = [request.node.get_closest_marker("launch") is not None]
    yield
    LAUNCHING.clear()


def _launching(cmd) -> None:
    if LAUNCHING and not LAUNCHING[0]:
        pytest.fail(f"a real launch in a test not marked launch: {' '.join(map(str, cmd))} "
                    "(mark the test @pytest.mark.launch, or run a computation with run_warm)")


def run(cmd: list[str], *, timeout: float = 300, cwd: Path = REPO, env: dict | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command as a user types it: `python script`, or the real torchrun, which
    starts its workers as fresh interpreters. stdout and stderr kept apart; on an
    unexpected status, fail with the output so the log says why. Tests marked `launch`."""
    cmd = [str(c) for c in cmd]
    _launching(cmd)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return _checked(proc, check)


def run_warm(cmd: list[str], *, timeout: float = 300, cwd: Path = REPO, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run a computation: the `python script` or `torchrun --standalone
    --nproc-per-node=N script` command `cmd`, its ranks forked from a warm interpreter
    (tests/warm.py) with the variables torchrun gives them. For tests of what a run
    computes, never of how it launches, stops or restarts."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return _checked(warm.run_warm(cmd, timeout=timeout, cwd=cwd, env=full_env), check)


def _checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def start(cmd: list[str], log: Path, *, env: dict | None = None, cwd: Path = REPO,
          netns: str | None = None, err_log: Path | None = None) -> subprocess.Popen:
    """Start a command that the test acts on while it runs (signals, kills), in a
    session of its own, as a terminal or SLURM starts a job; stdout and stderr appended
    to `log` (stderr to `err_log`, if given). netns: inside that network namespace,
    through `ip netns exec`. Tests marked `launch`."""
    cmd = [str(c) for c in cmd]
    _launching(cmd)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "a") as out, open(err_log or os.devnull, "a") as err:
        return subprocess.Popen([*(["ip", "netns", "exec", netns] if netns else []), *cmd], cwd=cwd,
                                env=full_env, stdout=out, stderr=err if err_log else subprocess.STDOUT,
                                start_new_session=True)


def a_machine_dies(tmp_path: Path, script: str, *flags, timeout: int = 20) -> None:
    """Two machines, one rank each: two processes of `script` that meet at MASTER_ADDR
    and MASTER_PORT, as the workers of two torchruns do. Once rank 0 has logged step 3,
    rank 1's machine dies whole (SIGKILL): rank 0, waiting on it in a collective or a
    send, must stop within --timeout (plus 60 s for a busy machine), with one line naming
    the cause and no traceback. For tests marked launch."""
    from procs import kill_job
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [start(python_cmd(script, *flags, "--max-steps", 100000, "--timeout", timeout, "--save-dir", tmp_path,
                              "--experiment-name", "lost"), log,
                   env={"RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ""})
             for i, log in enumerate(logs)]
    try:
        deadline = time.monotonic() + 240
        while "step 3/" not in logs[0].read_text():  # training runs (rank 0 logs)
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), \
                "\n".join(log.read_text()[-3000:] for log in logs)
            time.sleep(0.2)
        kill_job(nodes[1].pid)  # the whole machine of rank 1
        lost_at = time.monotonic()
        assert nodes[0].wait(timeout=timeout + 60) != 0, logs[0].read_text()[-3000:]
        took = time.monotonic() - lost_at
    finally:
        for node in nodes:
            kill_job(node.pid)
    out = logs[0].read_text()
    errors = [line for line in out.splitlines() if line.startswith("error: rank 0: a peer ")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert took < timeout + 60, took  # at most the timeout (a closed connection: at once)


def python_cmd(script: str | Path, *args) -> list[str]:
    return [sys.executable, str(REPO / script), *map(str, args)]


def torchrun_cmd(nproc: int, script: str | Path, *args, extra: list[str] | None = None) -> list[str]:
    """torchrun on one machine, as the READMEs launch it. --standalone starts its own
    rendezvous on a free port, so tests never collide on the default 29500."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *(extra or []), str(REPO / script), *map(str, args)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def chapter_on_path(chapter: str) -> None:
    """A chapter's folder first on the path, as when its scripts run: the modules beside
    them import by their plain names (`import proof`, `from train_llm import ...`), and a
    module of that name another chapter's folder gave is forgotten."""
    folder = REPO / chapter
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    for path in folder.glob("*.py"):
        module = sys.modules.get(path.stem)
        if module is not None and Path(getattr(module, "__file__", None) or "").parent != folder:
            del sys.modules[path.stem]


def chapter_module(chapter: str, name: str):
    """A module beside a chapter's scripts (05-collectives/proof.py, say)."""
    chapter_on_path(chapter)
    return importlib.import_module(name)


def load_script(rel_path: str):
    """A chapter script as a module (its folder name has a dash, so no plain import),
    with its folder on the path, as when it runs, for the modules beside it."""
    chapter_on_path(str(Path(rel_path).parent))
    name = rel_path.replace("/", "_").replace("-", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, REPO / rel_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def as_json(proc: subprocess.CompletedProcess) -> dict:
    return {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def from_json(d: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(d["args"], d["returncode"], d["stdout"], d["stderr"])


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """Chapter 04's reference run, which every resumed run must match: (process, run folder).
    Tests read it and copy it; none changes it."""
    from ch04_runs import NAME, THREADS, flags

    # the README's first command, its ranks started warm (tests/warm.py)
    def reference(save_dir):
        proc = run_warm([*readme_command("04-checkpointing/README.md", "--experiment-name ckpt-demo"),
                         *flags(save_dir)], timeout=120, env=THREADS)
        return {"proc": as_json(proc), "dir": str(save_dir)}
    made = made_once(tmp_path_factory, "ch04-ref", reference)
    return from_json(made["proc"]), Path(made["dir"]) / NAME


@pytest.fixture(scope="session")
def uninterrupted_on_3_ranks(tmp_path_factory):
    """The reference run on 3 ranks: its run folder."""
    from ch04_runs import NAME, train

    def reference(save_dir):
        train(save_dir, nproc=3)
        return str(save_dir)
    return Path(made_once(tmp_path_factory, "ch04-ref-3", reference)) / NAME


@pytest.fixture(scope="session")
def crashed(tmp_path_factory):
    """Chapter 04 with --crash-at-step and no torchrun restarts: the job fails after step
    7, with the checkpoints of steps 3 and 6 left. (process, run folder)"""
    from ch04_runs import CRASH, NAME, train

    made = made_once(tmp_path_factory, "ch04-crashed", lambda save_dir: {
        "proc": as_json(train(save_dir, "--crash-at-step", CRASH, check=False)), "dir": str(save_dir)})
    return from_json(made["proc"]), Path(made["dir"]) / NAME


# Chapter 01's reference run: the smoke run chapter 01's tests inspect, and the run
# chapter 02 must reproduce exactly. CUDA hidden, so that it trains on the CPU as chapter
# 02's fallback does, GPUs or not.
CH01_STEPS = 40
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="session")
def ch01_smoke(tmp_path_factory):
    """One 40-step run of the tiny preset, from the repo root (the README's first command,
    started warm; test_readmes.py runs it in a fresh interpreter, as a reader does):
    (process, run folder, metrics records, summary)."""
    def smoke(save_dir):
        proc = run_warm([*readme_command("01-single-gpu/README.md", "python 01-single-gpu/train_llm.py"), *TINY,
                    "--max-steps", CH01_STEPS, "--save-dir", save_dir, "--experiment-name", "smoke"], env=NO_GPU)
        return {"proc": as_json(proc), "dir": str(save_dir / "smoke")}
    made = made_once(tmp_path_factory, "ch01", smoke)
    run_dir = Path(made["dir"])
    return from_json(made["proc"]), run_dir, read_jsonl(run_dir / "metrics.jsonl"), \
        read_json(run_dir / "summary.json")


def small_corpus(folder: Path) -> Path:
    """A one-file corpus of 13 packed samples at --seq-length 32 and --vocab-size 300: an
    epoch lasts a few steps, so a short run crosses several."""
    corpus = Path(folder) / "tiny.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40)
    return corpus


SMALL_CORPUS_FLAGS = ["--vocab-size", "300", "--seq-length", "32"]

# Runs a chapter script (its path and arguments follow) and records, per rank, the index
# of every training sample it reads, in order: the first dataset read is the training one.
ORDER_PROBE = """
import json, os, runpy, sys
from pathlib import Path
from common import data
reads = []
real = data.PackedDataset.__getitem__
def getitem(self, i):
    reads.append((id(self), i))
    return real(self, i)
data.PackedDataset.__getitem__ = getitem
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script` has it
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:  # an exit from inside the script (sys.exit) too
    Path(__file__).with_name(f"order-{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps([i for d, i in reads if reads and d == reads[0][0]]))
"""


def training_order(folder: Path, launch, script: str, *args, env: dict | None = None) -> list[list[int]]:
    """The training samples each rank of `launch(script, *args)` read, in order (rank 0
    first); `launch` is `python_cmd` or a `torchrun_cmd` with its process count bound."""
    probe = Path(folder) / "order_probe.py"
    probe.write_text(ORDER_PROBE)
    proc = run_warm(launch(probe, REPO / script, *args), env=env)
    orders = sorted(Path(folder).glob("order-*.json"))
    assert orders, f"no rank recorded its order:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads(p.read_text()) for p in orders]


def shuffled_epochs(n: int, seed: int, epochs: int, batch: int, world: int = 1) -> list[list[int]]:
    """The samples each of `world` ranks trains on over `epochs` epochs of n samples with
    DistributedSampler(drop_last=True), set_epoch(epoch) and a DataLoader of `batch`
    with drop_last: randperm(n) seeded with seed + epoch, rank r taking every world-th
    element from r, cut to whole batches."""
    import torch
    orders = [[] for _ in range(world)]
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for r in range(world):
            share = perm[: n - n % world][r::world]
            orders[r] += share[: len(share) - len(share) % batch]
    return orders


def refused(capsys, parse, argv) -> str:
    """A script's parse_args on a bad command line, in this process: exit status 2 and
    one line on stderr, which is returned."""
    with pytest.raises(SystemExit) as exit_:
        parse([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def refused_on_ranks(capsys, monkeypatch, parse, world: int, argv) -> str:
    """`refused`, for a script torchrun launches: as rank 0 of `world` processes."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(k, v)
    return refused(capsys, parse, argv)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size in bytes (mount needs root; skipped where it fails)."""
    mounted = []

    def mount(size: int) -> Path:
        disk = tmp_path / f"disk-{len(mounted)}"
        disk.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
        mounted.append(disk)
        return disk
    yield mount
    for disk in mounted:  # lazy: a file a failed test left open must not keep it mounted
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@contextmanager
def run_folder_held(path: Path):
    """Another job's lock on the run folder `path` (claim_run_folder, in a process of its
    own) for as long as the block runs; yields that process (its pid is the owner's)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from common.runfolder import claim_run_folder; "
         "claim_run_folder(__import__('pathlib').Path(sys.argv[1])); print('held', flush=True); "
         "time.sleep(600)", str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
