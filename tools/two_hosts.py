"""Two machines on one Linux box: network namespaces joined by a cable (a veth pair).

Each "host" has its own network stack (its own loopback, its own address on the cable,
nothing else), its own cache folder (LLM_GUIDE_CACHE) and its own save folder: no shared
network, no shared filesystem, the way two real machines meet. A chapter then runs on
both with the command a reader types on two machines:

    sudo python -m tools.two_hosts 03-ddp/train_llm.py --max-steps 20
    sudo python -m tools.two_hosts --nproc-per-node 2 04-checkpointing/train_llm.py --experiment-name run1

It prints each host's command, runs them with their output prefixed [host1]/[host2],
and removes the namespaces on exit, Ctrl-C or failure. Needs root and `ip` (iproute2).
tests/test_two_hosts.py uses the functions below to cut the cable mid-run and more.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
IFNAME = "eth1"  # the cable's name inside each host: the same on both, as on a cluster
NETNS_ETC = Path("/etc/netns")  # per-namespace files that `ip netns exec` mounts over /etc


class HostError(Exception):
    """The hosts cannot be built here (not root, no `ip`, a bad subnet, ...)."""


@dataclass
class Hosts:
    names: list[str]       # network namespace (and host name) of host 1 and host 2
    addrs: list[str]       # their addresses on the cable
    dirs: list[Path]       # their private folders: <dir>/cache and <dir>/outputs
    ifname: str = IFNAME

    def cache(self, i: int) -> Path:
        return self.dirs[i] / "cache"

    def save_dir(self, i: int) -> Path:
        return self.dirs[i] / "outputs"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HostError(f"ip {' '.join(args)}: {proc.stderr.strip() or 'failed'}")


def check_can_create() -> None:
    """Raise HostError with the reason when namespaces cannot be made here."""
    if not sys.platform.startswith("linux"):
        raise HostError("network namespaces need Linux")
    if os.geteuid() != 0:
        raise HostError("creating network namespaces needs root (run with sudo)")
    if shutil.which("ip") is None:
        raise HostError("the `ip` command is missing (Debian/Ubuntu: apt-get install iproute2)")


def host_addresses(subnet: str) -> list[str]:
    """The first two addresses of an IPv4 subnet such as 10.77.0.0/24."""
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise HostError(f"--subnet {subnet!r} is not an IPv4 network like 10.77.0.0/24 ({e})") from None
    if net.num_addresses < 4:
        raise HostError(f"--subnet {subnet}: too small for two hosts (use /30 or larger)")
    return [str(net.network_address + 1), str(net.network_address + 2)]


def check_prefix(prefix: str) -> None:
    """A prefix every name built from it accepts: namespaces, /etc/netns folders, and the
    cable's ends (network interface names: at most 15 characters, no spaces or slashes)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", prefix):
        raise HostError(f"--prefix {prefix!r}: use only letters, digits, '.', '_' and '-' "
                        f"(it names namespaces and network interfaces)")
    if len(prefix) > 13:
        raise HostError(f"--prefix {prefix!r} is too long (at most 13 characters)")


def check_workdir(workdir: Path) -> None:
    """The hosts' folders can be made under workdir (checked before any namespace exists)."""
    for i in (1, 2):
        for sub in ("cache", "outputs"):
            folder = Path(workdir) / f"host{i}" / sub
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise HostError(f"--workdir {str(workdir)!r}: cannot create {folder} "
                                f"({e.strerror or e})") from None


def create_hosts(workdir: Path, *, prefix: str = "llmg", subnet: str = "10.77.0.0/24") -> Hosts:
    """Two namespaces <prefix>-host1/2, a cable between them with the subnet's first two
    addresses, loopback up in each (torchrun and gloo talk to themselves through it),
    and a private cache and save folder per host under workdir. Everything that can be
    checked is checked before the first namespace is made, so a refusal leaves none."""
    check_can_create()
    check_prefix(prefix)
    addrs = host_addresses(subnet)
    check_workdir(workdir)
    prefixlen = ipaddress.IPv4Network(subnet).prefixlen
    names = [f"{prefix}-host1", f"{prefix}-host2"]
    ends = [f"{prefix}-a", f"{prefix}-b"]  # the cable's ends before they move in (<= 15 chars)
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    if any(n in existing for n in names):
        raise HostError(f"namespaces {names[0]}/{names[1]} already exist: another run is going on, "
                        f"or remove them with `python -m tools.two_hosts --teardown --prefix {prefix}`")
    hosts = Hosts(names, addrs, [Path(workdir) / "host1", Path(workdir) / "host2"])
    if any((NETNS_ETC / n).exists() for n in names):
        raise HostError(f"{NETNS_ETC / names[0]} already exists; remove it or choose another --prefix")
    try:
        for name, addr in zip(names, addrs):
            _ip("netns", "add", name)
            # `ip netns exec` mounts /etc/netns/<name>/hosts over /etc/hosts: each host
            # resolves its own name (as a machine's /etc/hosts does), not the other's.
            (NETNS_ETC / name).mkdir(parents=True)
            (NETNS_ETC / name / "hosts").write_text(Path("/etc/hosts").read_text() + f"{addr} {name}\n")
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for name, end, addr in zip(names, ends, addrs):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "link", "set", end, "name", IFNAME)
            _ip("-n", name, "addr", "add", f"{addr}/{prefixlen}", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except BaseException:
        teardown(hosts)
        raise
    return hosts


def in_host(hosts: Hosts, i: int, argv: list[str], *, env: dict | None = None,
            **popen_kwargs) -> subprocess.Popen:
    """Start argv inside host i (0 or 1), from the repository root, with the host's own
    LLM_GUIDE_CACHE. `ip netns exec` execs argv, so the Popen is the command itself."""
    full_env = {**os.environ, "LLM_GUIDE_CACHE": str(hosts.cache(i)), "PYTHONUNBUFFERED": "1",
                **(env or {})}
    popen_kwargs.setdefault("cwd", REPO_ROOT)
    return subprocess.Popen(["ip", "netns", "exec", hosts.names[i], *map(str, argv)],
                            env=full_env, **popen_kwargs)


def host_pids(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def cut_link(hosts: Hosts) -> None:
    """Pull the cable: host 1's end goes down, so nothing passes either way."""
    _ip("-n", hosts.names[0], "link", "set", hosts.ifname, "down")


def restore_link(hosts: Hosts) -> None:
    _ip("-n", hosts.names[0], "link", "set", hosts.ifname, "up")


def teardown(hosts: Hosts) -> None:
    """Kill whatever still runs in the hosts, then delete them (the cable goes with
    them). Safe to call twice and on half-built hosts."""
    remove_namespaces(hosts.names)


def remove_namespaces(names: list[str]) -> None:
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in [n for n in names if n in existing]:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = host_pids(name)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while pids and host_pids(name) and time.monotonic() < deadline:
                time.sleep(0.1)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for name in names:  # the folders create_hosts made, nothing else
        folder = NETNS_ETC / name
        if folder.is_dir() and [p.name for p in folder.iterdir()] == ["hosts"]:
            shutil.rmtree(folder)
    if NETNS_ETC.is_dir() and not any(NETNS_ETC.iterdir()):
        NETNS_ETC.rmdir()  # empty: made by create_hosts (ip netns exec works without it)


def torchrun_argv(hosts: Hosts, i: int, script: str, script_args: list[str], *, port: int,
                  nproc_per_node: int = 1, rdzv_id: str = "two-hosts",
                  torchrun: list[str] | None = None) -> list[str]:
    """What a reader types on machine i: the rendezvous is hosted by host 1 at its
    address. --local-addr: what this machine tells the others to dial; without it
    torchrun advertises socket.getfqdn(), which here (and on many machines whose
    /etc/hosts maps the host name to 127.0.x.1) names the loopback. is_host=1 on host 1:
    torchrun recognises the endpoint as its own only if the host name resolves to it."""
    conf = ["--rdzv-conf=is_host=1"] if i == 0 else []
    return [*(torchrun or ["torchrun"]), "--nnodes=2", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.addrs[0]}:{port}",
            f"--rdzv-id={rdzv_id}", f"--local-addr={hosts.addrs[i]}", *conf,
            script, *script_args, "--save-dir", str(hosts.save_dir(i))]


def _relay(stream, tag: str) -> None:
    for line in iter(stream.readline, ""):
        print(f"{tag} {line}", end="", flush=True)


def run_on_both(hosts: Hosts, argvs: list[list[str]], env: dict | None = None) -> list[int]:
    """Start both commands, relay their output tagged [host1]/[host2], wait for both."""
    procs, threads = [], []
    for i, argv in enumerate(argvs):
        p = in_host(hosts, i, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, start_new_session=True)  # Ctrl-C reaches us, we tear down
        t = threading.Thread(target=_relay, args=(p.stdout, f"[host{i + 1}]"), daemon=True)
        t.start()
        procs.append(p)
        threads.append(t)
    statuses = [p.wait() for p in procs]
    for t in threads:
        t.join(timeout=5)
    return statuses


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.two_hosts",
        description="Run a chapter on two simulated machines (Linux network namespaces joined "
                    "by a veth pair; separate caches and save folders). Needs root and iproute2.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("script", nargs="?", help="chapter script, e.g. 03-ddp/train_llm.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="flags passed to the script")
    p.add_argument("--subnet", default="10.77.0.0/24",
                   help="the cable's network; host 1 and host 2 get its first two addresses")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per host")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on host 1")
    p.add_argument("--prefix", default="llmg", help="name prefix of the namespaces")
    p.add_argument("--workdir", default=str(REPO_ROOT / "outputs" / "two-hosts"),
                   help="holds host1/ and host2/, each with its own cache/ and outputs/")
    p.add_argument("--teardown", action="store_true",
                   help="only remove namespaces left by an earlier run with this --prefix")
    p.error = lambda message: _usage_error(f"{message} (see --help)")
    return p.parse_args(argv)


def _usage_error(message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_prefix(args.prefix)  # before anything is made or removed
        if not args.teardown and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
            raise HostError(f"--workdir {args.workdir!r} exists and is not a folder")
        check_can_create()
        if args.teardown:
            remove_namespaces([f"{args.prefix}-host1", f"{args.prefix}-host2"])
            return 0
        if not args.script:
            raise HostError("name a chapter script, e.g. 03-ddp/train_llm.py (see --help)")
        if not (REPO_ROOT / args.script).is_file():
            raise HostError(f"{args.script!r} is not a script under {REPO_ROOT}")
        if args.nproc_per_node < 1:
            raise HostError(f"--nproc-per-node must be at least 1 (got {args.nproc_per_node})")
        if not 1024 <= args.port <= 65535:
            raise HostError(f"--port must be between 1024 and 65535 (got {args.port})")
        host_addresses(args.subnet)
    except HostError as e:
        _usage_error(str(e))

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` tears down like Ctrl-C does
    hosts = None
    try:
        hosts = create_hosts(Path(args.workdir), prefix=args.prefix, subnet=args.subnet)
        argvs = [torchrun_argv(hosts, i, args.script, args.script_args, port=args.port,
                               nproc_per_node=args.nproc_per_node) for i in range(2)]
        env = {"GLOO_SOCKET_IFNAME": hosts.ifname}
        for i, argv in enumerate(argvs):
            print(f"host{i + 1} ({hosts.addrs[i]}, namespace {hosts.names[i]}): "
                  f"GLOO_SOCKET_IFNAME={hosts.ifname} {shlex.join(argv)}", flush=True)
        torchrun = shutil.which("torchrun")
        runner = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
        argvs = [runner + argv[1:] for argv in argvs]
        statuses = run_on_both(hosts, argvs, env=env)
        print(f"exit status: host1 {statuses[0]}, host2 {statuses[1]}", flush=True)
        worst = max(statuses, key=abs)
        return 128 - worst if worst < 0 else worst  # killed by signal N: 128 + N, as a shell says
    except HostError as e:
        _usage_error(str(e))
    except KeyboardInterrupt:
        print("interrupted: removing the hosts", file=sys.stderr, flush=True)
        return 130
    finally:
        if hosts is not None:
            teardown(hosts)


if __name__ == "__main__":
    sys.exit(main())
