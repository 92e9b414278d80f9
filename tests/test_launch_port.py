"""The launcher's rendezvous port (`disttrain run` / `lightning run model`): a taken default is replaced by a free
port on one node; a taken port the user chose, or a taken port with several nodes, ends the launch in one line.

Each test takes a port of its own and holds it with a listening socket, as another run would, and passes it as the
launcher's default where the default is tested: 29400 itself may be in use by a concurrent test."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, child_env, worker_ports
from disttrain import ports
from disttrain.cli import port_taken, rendezvous_port

BIN = Path(sys.executable).parent


@pytest.fixture
def held() -> Iterator[int]:
    """A port that a program on this machine listens on for the duration of the test."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def test_a_taken_default_is_replaced_by_a_free_port_on_one_node(held, capsys):
    assert port_taken(held)
    port = rendezvous_port(None, default=held, prog="lightning run model")
    assert port != held and not port_taken(port)
    assert capsys.readouterr().err == (f"lightning run model: port {held} (the default --main-port) is in use;"
                                       f" using free port {port}\n")
    assert rendezvous_port(None, max_restarts=2, default=held) not in (held, port)  # c10d on one node too


def test_a_free_default_or_chosen_port_is_used_as_it_is(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert rendezvous_port(None, default=free) == free
    assert rendezvous_port(free) == free
    assert capsys.readouterr().err == ""


def test_a_taken_port_the_user_chose_ends_the_launch_in_one_line(held):
    with pytest.raises(SystemExit) as stop:
        rendezvous_port(held, prog="disttrain run")
    message = str(stop.value.code)
    assert message.startswith(f"disttrain run: error: --main-port {held} is in use on this machine") and (
        "leave --main-port out to get one" in message and "\n" not in message), message


def test_several_nodes_must_agree_so_node_zero_ends_the_launch_in_one_line(held):
    for chosen in (None, held):  # the default or the user's port: the other nodes cannot learn a replacement
        with pytest.raises(SystemExit) as stop:
            rendezvous_port(chosen, num_nodes=4, node_rank=0, default=held, prog="lightning run model")
        message = str(stop.value.code)
        assert message.startswith(f"lightning run model: error: port {held} is in use on this node (node rank 0"
                                  " hosts the rendezvous), and all 4 nodes must use the same port: pass --main-port")
        assert "\n" not in message
    # the other nodes only connect to node 0's port; with restarts (c10d) torchrun decides who hosts the store
    assert rendezvous_port(None, num_nodes=4, node_rank=2, default=held) == held
    assert rendezvous_port(held, num_nodes=4, node_rank=0, max_restarts=1) == held


def test_a_free_port_lies_below_the_ephemeral_range_and_skips_a_taken_one():
    """A picked port is one no outgoing connection can be given meanwhile (below the kernel's ephemeral range, where
    bind(0) picks), not in use, and successive picks differ; a port a program listens on is passed over."""
    ephemeral = ports.ephemeral_ports()
    picked = [ports.free_port() for _ in range(3)]
    assert all(ephemeral.start - ports.SPAN <= p < ephemeral.start and not port_taken(p) for p in picked), picked
    assert len(set(picked)) == 3
    with socket.socket() as server:
        server.bind(("", picked[0]))
        server.listen()
        assert [ports.free_port(within=range(picked[0], picked[0] + 2)) for _ in range(2)] == [picked[0] + 1] * 2
        with pytest.raises(RuntimeError, match=f"every port from {picked[0]} to {picked[0]} is in use"):
            ports.free_port(within=range(picked[0], picked[0] + 1))


def test_each_test_worker_has_ports_of_its_own_apart_from_the_launchers(monkeypatch):
    """make test's workers pick from disjoint ranges, none of them the launchers' default span or torchrun's
    default ports: two tests never race for one port."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        shares.append(set(worker_ports()))
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    launcher = set(range(ports.ephemeral_ports().start - ports.SPAN, ports.ephemeral_ports().start))
    assert not (shares[0] | shares[1]) & (launcher | {29400, 29500})


@pytest.mark.slow
def test_launcher_with_the_default_port_taken_runs_on_a_free_one_and_a_taken_main_port_stops_it(held, tmp_path):
    out = tmp_path / "cli"
    launcher_args = ["tests/dist/cli_fabric.py", "--accelerator", "cpu", "--devices", "2",
                     "--strategy", "disttrain_ddp", str(out)]
    # `lightning run model` whose default port is the one held: the ranks start on a free port and train
    code = ("import sys; from disttrain.cli import launch;"
            f" raise SystemExit(launch(sys.argv[1:], prog='lightning run model', default_port={held}))")
    proc = subprocess.run([sys.executable, "-c", code, *launcher_args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notice = f"lightning run model: port {held} (the default --main-port) is in use; using free port "
    assert proc.stderr.startswith(notice), proc.stderr[:2000]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["losses"] == ranks[1]["losses"]

    # the console script with the held port passed: one line, exit status 1, no process started
    proc = subprocess.run([str(BIN / "lightning"), "run", "model", *launcher_args, "--main-port", str(held)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lightning run model: error: --main-port {held} is in use"), (
        proc.stderr[-4000:])
