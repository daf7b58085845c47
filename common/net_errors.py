"""Network trouble in a job across machines, said in one line that names the fix.

`check_network(backend)` runs before init_process_group and stops at once (exit 2) on the
setups that otherwise fail at the first connection, or wait there until a timeout:
rank 0's advertised address is a loopback or does not resolve (torchrun without
--local-addr), or gloo would advertise a missing or loopback interface. It speaks on the
machines that can tell; rank 0's machine cannot tell whether the other nodes share it,
so there a wrong setting shows as "a peer stopped answering" after --timeout
(`common.errors.explain_peer_failures`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys

from .errors import fail_on_each_machine, reachable

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_address(name: str) -> str | None:
    """The IPv4 address of a network interface, or None if it has none or does not exist."""
    import fcntl  # Linux (the callers check); not on Windows
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str]:
    """name -> IPv4 address of every interface that has one."""
    found = {name: interface_address(name) for _, name in socket.if_nameindex()}
    return {name: addr for name, addr in found.items() if addr}


def interface_towards(ip: str) -> str | None:
    """The interface this machine sends from to reach ip (what `ip route get` says)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # UDP: no packet is sent, the kernel only picks a route
        except OSError:
            return None
        source = s.getsockname()[0]
    by_addr = {addr: name for name, addr in interfaces().items()}
    return by_addr.get(source)


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def check_network(backend: str) -> None:
    """Under torchrun, with several nodes: stop with one line if this process cannot
    reach rank 0, or if gloo would give the other machines an address they cannot
    reach. Nodes that share one machine (loopback) pass; one node: no-op."""
    if "RANK" not in os.environ:
        return
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        return  # one node: loopback is all it needs
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        master_ips = sorted({ai[4][0] for ai in socket.getaddrinfo(master, None, socket.AF_INET)})
    except socket.gaierror:
        fail_on_each_machine(
            f"MASTER_ADDR={master}, the address rank 0's machine advertised, does not resolve "
            f"on this machine; start torchrun on every machine with --local-addr=<that "
            f"machine's IP address>, or make the name resolvable (DNS or /etc/hosts)")
    master_is_loopback = all(_is_loopback(ip) for ip in master_ips)
    # rank 0's store listens at MASTER_ADDR:MASTER_PORT before any worker starts; a
    # loopback address that does not answer is rank 0's name for itself, on another machine
    if master_is_loopback and not reachable(master, port):
        fail_on_each_machine(
            f"MASTER_ADDR={master} ({master_ips[0]}) is a loopback address, so the other "
            f"machines cannot reach rank 0: torchrun advertised its host name, which resolves "
            f"to the loopback on that machine; start torchrun on every machine with "
            f"--local-addr=<that machine's IP address>")
    if backend != "gloo" or not sys.platform.startswith("linux"):
        return  # nccl: see NCCL_SOCKET_IFNAME in 03-ddp/README.md
    # On rank 0's own machine the other nodes may share it (then the loopback is fine);
    # elsewhere, rank 0 is on another machine, which must be able to reach us.
    own = interfaces()
    on_rank0_machine = master_is_loopback or any(ip in own.values() for ip in master_ips)
    route = interface_towards(master_ips[0])
    fix = f"GLOO_SOCKET_IFNAME={route}" if route else "GLOO_SOCKET_IFNAME=<interface>"
    have = ", ".join(f"{n} {a}" for n, a in own.items())
    names = os.environ.get("GLOO_SOCKET_IFNAME")
    if names:
        for name in names.split(","):
            addr = interface_address(name)
            if addr is None:
                fail_on_each_machine(
                    f"GLOO_SOCKET_IFNAME={name}: this machine has no such interface with an "
                    f"IPv4 address (it has: {have}); set {fix}, the interface that reaches "
                    f"MASTER_ADDR={master}")
            if _is_loopback(addr) and not on_rank0_machine:
                fail_on_each_machine(
                    f"GLOO_SOCKET_IFNAME={name} is the loopback ({addr}), which the other "
                    f"machines cannot reach; set {fix}, the interface that reaches "
                    f"MASTER_ADDR={master}")
        return
    if on_rank0_machine:
        return
    # Without GLOO_SOCKET_IFNAME, gloo advertises the address its host name resolves to.
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = None
    if addr is None or _is_loopback(addr):
        where = f"resolves to the loopback {addr}" if addr else "does not resolve"
        fail_on_each_machine(
            f"gloo would advertise this machine by its host name {host!r}, which {where}, so "
            f"the other machines cannot reach it; set {fix}, the interface that reaches "
            f"MASTER_ADDR={master}")
