"""common.net_errors.check_network, branch by branch, in this process: a worker of a job
across machines (the variables torchrun gives it), and each wrong network setting of
03-ddp/README.md's table as one line that names the fix, exit status 2. The two
settings a reader gets by default (no --local-addr, no GLOO_SOCKET_IFNAME) also run on two
real network hosts in tests/test_two_hosts.py, which shows that the line comes at once
there and what rank 0's machine says meanwhile."""

from __future__ import annotations

import socket

import pytest

from common import net_errors
from common.net_errors import check_network

OTHER_MACHINE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): an address no interface here has
ROUTE = "eth1"               # the interface the route to it leaves by, as on the two hosts


@pytest.fixture
def worker(monkeypatch):
    """Rank 1 of 2, one process per machine, rank 0 on another machine; returns a function
    that changes the variables."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(net_errors, "interface_towards", lambda ip: ROUTE)

    def env(**variables):
        base = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": OTHER_MACHINE, "MASTER_PORT": "29500"}
        for k, v in {**base, **variables}.items():
            monkeypatch.setenv(k, str(v))
    env()
    return env


def refused(capsys, backend="gloo") -> str:
    with pytest.raises(SystemExit) as exit_info:
        check_network(backend)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def passes(capsys, backend="gloo"):
    check_network(backend)
    assert capsys.readouterr().err == ""


def test_a_missing_interface_names_the_one_that_reaches_rank_0(worker, capsys):
    worker(GLOO_SOCKET_IFNAME="nope")
    line = refused(capsys)
    assert line.startswith("error: GLOO_SOCKET_IFNAME=nope: this machine has no such interface "
                           "with an IPv4 address (it has: lo 127.0.0.1")
    assert line.endswith(f"set GLOO_SOCKET_IFNAME={ROUTE}, the interface that reaches "
                         f"MASTER_ADDR={OTHER_MACHINE}")


def test_the_loopback_is_refused_away_from_rank_0_and_allowed_beside_it(worker, capsys):
    worker(GLOO_SOCKET_IFNAME="lo")
    assert refused(capsys).startswith("error: GLOO_SOCKET_IFNAME=lo is the loopback (127.0.0.1), which "
                                      f"the other machines cannot reach; set GLOO_SOCKET_IFNAME={ROUTE}")
    # two "nodes" on one machine (rank 0's store answers on the loopback): nothing to fix
    with socket.create_server(("127.0.0.1", 0)) as store:
        worker(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=store.getsockname()[1])
        passes(capsys)


@pytest.mark.parametrize("resolves_to, says", [("127.0.1.1", "which resolves to the loopback 127.0.1.1"),
                                               (None, "which does not resolve")],
                         ids=["loopback", "unresolvable"])
def test_unset_ifname_and_a_host_name_the_others_cannot_reach(worker, capsys, monkeypatch, resolves_to, says):
    """Without GLOO_SOCKET_IFNAME gloo advertises the address of the machine's host name."""
    def resolve(name):
        if resolves_to is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return resolves_to
    monkeypatch.setattr(net_errors.socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(net_errors.socket, "gethostbyname", resolve)
    line = refused(capsys)
    assert line.startswith(f"error: gloo would advertise this machine by its host name 'node7', {says}, "
                           f"so the other machines cannot reach it; set GLOO_SOCKET_IFNAME={ROUTE}")
    # a host name with the machine's address: gloo's default is right
    monkeypatch.setattr(net_errors.socket, "gethostbyname", lambda name: "10.77.0.2")
    passes(capsys)


def test_a_loopback_master_addr_that_does_not_answer_is_rank_0s_name_for_itself(worker, capsys):
    """torchrun without --local-addr advertises rank 0's host name; where that name is the
    loopback, nothing listens at MASTER_ADDR:MASTER_PORT on this machine."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: a port nothing listens on
    worker(MASTER_ADDR="localhost", MASTER_PORT=port)
    assert refused(capsys).startswith("error: MASTER_ADDR=localhost (127.0.0.1) is a loopback address, "
                                      "so the other machines cannot reach rank 0")


def test_a_master_addr_this_machine_cannot_resolve(worker, capsys, monkeypatch):
    def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(net_errors.socket, "getaddrinfo", no_such_name)
    worker(MASTER_ADDR="host1")
    assert refused(capsys).startswith("error: MASTER_ADDR=host1, the address rank 0's machine advertised, "
                                      "does not resolve on this machine; start torchrun on every machine "
                                      "with --local-addr=")


def test_what_it_does_not_check(worker, capsys):
    """One node (loopback is all it needs), not under torchrun, and nccl (its own
    NCCL_SOCKET_IFNAME): a wrong GLOO_SOCKET_IFNAME passes; the other local ranks of a
    machine exit 2 without a line of their own."""
    worker(GLOO_SOCKET_IFNAME="nope", LOCAL_WORLD_SIZE=2)
    passes(capsys)
    worker(GLOO_SOCKET_IFNAME="nope")
    passes(capsys, backend="nccl")
    worker(GLOO_SOCKET_IFNAME="nope", RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)
    with pytest.raises(SystemExit) as exit_info:
        check_network("gloo")
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


def test_without_torchrun_nothing_is_checked(worker, capsys, monkeypatch):
    worker(GLOO_SOCKET_IFNAME="nope")
    monkeypatch.delenv("RANK")
    passes(capsys)


def test_the_interface_towards_an_address_is_the_one_holding_the_source_address():
    """What `ip route get` says: the loopback for 127.0.0.1 (the route is this machine's
    own; an address with no route at all gives None)."""
    assert net_errors.interface_towards("127.0.0.1") == "lo"
    assert net_errors.interfaces()["lo"] == "127.0.0.1"
    assert net_errors.interface_address("no-such-interface") is None
