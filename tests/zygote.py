"""A warm interpreter for the suite's launches: it imports torch once, then forks a
fresh process for every launch it is asked for, so a launch costs a fork, not the 2-3 s
of CPU that `import torch` takes in every new interpreter.

It never runs a torch operation itself (no thread pool to inherit across fork). Each
request (one JSON line on stdin) names a script (or `-m module`), its arguments,
environment, folder and output files, and a number of ranks: 0 runs the script as
`python script.py` would; N >= 1 runs N ranks with the variables torchrun gives its
workers, each in a session of its own as torchrun starts them, under a small launcher
process that, like torchrun, passes SIGTERM and SIGINT on to each rank's process group
and then ends the job, stops the other ranks when one fails, starts them all again while
`max_restarts` allows (TORCHELASTIC_RESTART_COUNT counts up), and otherwise exits 1.
The reply lines on stdout: {"started": pid}, later {"pid": pid, "status": code}, where
code is the exit status, or -signal. The pid is the launcher's (a process group leader);
its children are the ranks (tests/warm.py: kill_launch stops them all)."""

import atexit
import ctypes
import gc
import importlib
import inspect
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time

from warm import free_port  # this folder is on the path: the script's own

# the point: imported once here, inherited by every fork (the repo's own modules too).
# torch._dynamo is imported by the first optimizer any script builds (torch.optim's
# constructors are wrapped by torch._disable_dynamo): 1.5-2 s of CPU in every rank.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.pipelining", "torch.nn.functional", "torch.nn.parallel",
           "torch.profiler", "torch.utils.data", "numpy", "tokenizers"]
COMMON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common")
PRELOAD += sorted(f"common.{name[:-3]}" for name in os.listdir(COMMON)
                  if name.endswith(".py") and name != "__init__.py")
STARTUP_PATH = list(sys.path)  # [this folder, the interpreter's own entries...]
EXECUTE_CHILD = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]
RANK_GRACE_S = 30  # torchrun's default grace between SIGTERM and SIGKILL of the others
STOPPED = []  # signals the launcher got (a launcher process serves one launch)


def become(request: dict, env: dict) -> None:
    """In a forked child: the process `python script args` would be, then run it."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    torch.distributed.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG, read at import
    os.chdir(request["cwd"])
    if request.get("fork_workers") and request["argv"][:2] == ["-m", "torch.distributed.run"]:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
        subprocess_handler.Popen = ForkedWorker  # what torchrun's agent starts its workers with
    try:
        if request["argv"][0] == "-m":  # `python -m module args`: the current folder on the path
            sys.argv = [request["argv"][1], *request["argv"][2:]]
            sys.path[:] = [os.getcwd(), *STARTUP_PATH[1:]]
            runpy.run_module(request["argv"][1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.realpath(os.path.join(request["cwd"], request["argv"][0]))
            sys.argv = [request["argv"][0], *request["argv"][1:]]
            sys.path[:] = [os.path.dirname(script), *STARTUP_PATH[1:]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = exit_status(e.code)
    except KeyboardInterrupt:  # uncaught: the interpreter's own exit (traceback, then SIGINT)
        atexit.register(gc.unfreeze)  # see exit_as_python_does
        raise
    except BaseException:  # uncaught: its traceback, then the exit, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_as_python_does(code)


def exit_status(code) -> int:
    """The status `sys.exit(code)` gives: None 0, an int itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_as_python_does(code: int) -> None:
    """What an interpreter does at exit that a script can see (other threads joined, the
    atexit handlers, the script's objects finalized, the streams flushed), then the exit
    itself, without tearing down what the zygote imported. That teardown would touch
    every object torch made, copying each page of them into this fork: 0.4 s of CPU per
    process, 1.5 s once the frozen objects are unfrozen (and left frozen, objects of
    extension modules outlive their module: triton's bindings print a leak report)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()  # what the script made and left (the frozen imports are not walked)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class ForkedWorker(subprocess.Popen):
    """How torchrun, itself run in a fork of this interpreter, starts a worker: its
    command `python -u script args` becomes a fork of torchrun's own process that runs the
    script as that command would, in a session of its own, with torchrun's environment
    and output files, every other descriptor closed and the signals as a new interpreter
    has them; so the worker has imported torch already. Anything else (another command,
    descriptors to pass on, a torchrun that added exit handlers this fork would run)
    starts as usual."""

    def _execute_child(self, *args):
        a = dict(zip(EXECUTE_CHILD, args))
        argv, fds = list(a["args"]), (a["p2cread"], a["c2pwrite"], a["errwrite"])
        if argv[:2] != [sys.executable, "-u"] or len(argv) < 3 or not argv[2].endswith(".py") \
                or a["pass_fds"] or a["preexec_fn"] or a["shell"] or {0, 1, 2} & set(fds) \
                or atexit._ncallbacks() != EXIT_HOOKS:
            return super()._execute_child(*args)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            be_worker(argv[2:], a["cwd"] or os.getcwd(), a["env"], fds, a["start_new_session"])
        self.pid, self._child_created = pid, True
        self._close_pipe_fds(a["p2cread"], a["p2cwrite"], a["c2pread"], a["c2pwrite"],
                             a["errread"], a["errwrite"])


KEPT = []  # torchrun's streams in a forked worker: their descriptors are closed, never finalize them


def be_worker(argv: list[str], cwd: str, env: dict, fds: tuple, new_session: bool) -> None:
    """In the fork: torchrun's worker process, as exec would have made it."""
    try:
        if new_session:
            os.setsid()
        for fd, target in zip(fds, (0, 1, 2)):
            if fd != -1:
                os.dup2(fd, target)
        gc.freeze()  # torchrun's objects: never collected here (nor their descriptors closed)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as Popen's close_fds
        for sig in signal.valid_signals():
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        KEPT.extend((sys.stdin, sys.stdout, sys.stderr))
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        # `python -u`: the text layer right over the descriptor, written through
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding=KEPT[-2].encoding, write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding=KEPT[-1].encoding,
            errors="backslashreplace", write_through=True)
        become({"argv": argv, "cwd": cwd}, env)
    except BaseException:  # the fork itself broke, before the script ran: say so where torchrun reads
        import traceback
        traceback.print_exc()
    finally:
        os._exit(1)


CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_BIND, MS_REC, MS_SLAVE, MNT_DETACH = 0x1000, 0x4000, 0x80000, 2


def enter_host(name: str) -> None:
    """What `ip netns exec NAME` does before it runs its command (iproute2's netns_switch):
    join the network namespace NAME, then, in a mount namespace of its own, mount a /sys
    that shows NAME's interfaces and /etc/netns/NAME/* over /etc/* (the host's own
    /etc/hosts: tools/two_hosts.py)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), f"setns {name}")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount --make-rslave /")
    if libc.umount2(b"/sys", MNT_DETACH) == 0:  # as ip does: no sysfs there is fine
        check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")
    etc = f"/etc/netns/{name}"
    for entry in sorted(os.listdir(etc)) if os.path.isdir(etc) else []:
        check(libc.mount(f"{etc}/{entry}".encode(), f"/etc/{entry}".encode(), None, MS_BIND, None),
              f"bind {etc}/{entry}")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """glibc's malloc in every fork: large blocks from the heap too, and freed memory kept
    for the next allocation instead of handed back to the kernel. By default each block
    over a few MB is mapped fresh and unmapped when freed, so a step that makes and drops
    a copy of the parameters pays page faults for every page, every time (a 3-rank proof
    of chapter 05: 9.5 s of system CPU, 5.6 s with this). Only how fast memory is reused
    changes; torch's own accounting (MemTracker, the CUDA allocator) does not. Not on a
    libc without mallopt."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


def redirect(request: dict) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    sys.stdin = open(os.devnull)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def launch_ranks(request: dict) -> int:
    """torchrun --standalone --nproc-per-node=N [--max-restarts=K], as far as its workers
    can tell: when a rank fails, the others are stopped and, while restarts are left, all
    ranks start again with TORCHELASTIC_RESTART_COUNT one higher (same job id, a new
    port); with none left, the launcher exits 1."""
    restarts = request.get("max_restarts", 0)
    port = request["port"]
    for attempt in range(restarts + 1):
        if launch_attempt(request, attempt, restarts, port) == 0:
            return 0
        if STOPPED:
            break
        port = free_port()
    return 1


def launch_attempt(request: dict, attempt: int, restarts: int, port: int) -> int:
    n = request["nproc"]
    base = {**request["env"], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(n),
            "TORCHELASTIC_RUN_ID": f"warm-{os.getpid()}", "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(restarts), "TORCHELASTIC_USE_AGENT_STORE": "False"}
    ranks = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.setsid()  # as torchrun starts each worker: a session (and process group) of its own
            become(request, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                             "ROLE_RANK": str(rank)})
        ranks[pid] = rank
    # a signal to the launcher is passed on to each rank's process group, as torchrun's
    # agent does; and, as there, it ends the job: no restart follows
    def pass_on(sig, _):
        STOPPED.append(sig)
        signal_groups(ranks, sig)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, pass_on)
    failed = False
    deadline = None
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
        except ChildProcessError:
            break
        if pid == 0:
            if time.monotonic() > deadline:
                signal_groups(ranks, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)
            continue
        ranks.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            signal_groups(ranks, signal.SIGTERM)
            deadline = time.monotonic() + RANK_GRACE_S
    return 1 if failed else 0


def signal_groups(ranks, sig) -> None:
    for pid in ranks:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # exited, and its group with it
            pass


def start(request: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setpgid(0, 0)
        redirect(request)
        if request.get("netns"):
            enter_host(request["netns"])
        if request["nproc"] == 0:
            become(request, request["env"])
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        code = launch_ranks(request)
    except (SystemExit, KeyboardInterrupt):  # the interpreter's own exit, as in `python`
        raise
    except BaseException:  # the launcher itself broke: say so where the test reads
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reply(message: dict) -> None:
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def serve() -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children = set()
    stdin = sys.stdin.fileno()
    buffer = b""
    while True:
        ready, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            reply({"pid": pid, "status": os.waitstatus_to_exitcode(status)})
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pid = start(json.loads(line))
                children.add(pid)
                reply({"started": pid})


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # the repo
    for name in PRELOAD:
        importlib.import_module(name)
    import torch.distributed
    # What the imports made lives as long as every fork: out of the collector's reach, a
    # fork's collections do not walk those objects (touching their pages copies them into
    # the fork): half the CPU a short launch of two ranks costs (3.4 -> 1.8 s)
    gc.freeze()
    keep_freed_memory()
    EXIT_HOOKS = atexit._ncallbacks()
    serve()
