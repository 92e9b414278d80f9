"""Runs across hosts that are really separate network stacks: tools/hosts.py's network namespaces (each host its own
eth0, address and hostname, cabled to a bridge), GLOO_SOCKET_IFNAME=eth0. The launches of `disttrain run`, torchrun
and `disttrain calibrate` start one agent per host with its rendezvous on host 0's address, as docs/multi-node.md
prescribes (the ranks an agent starts are forks that join its host: tests/zygote.py's join_host), and so does the
HSDP run of tests/dist/multi_node.py (the documented command); the strategies' other runs of it fork their ranks
into the hosts (conftest.run_dist with ``hosts``: the ranks torchrun would start, in the host's network under its
name, seconds of imports cheaper; DISTTRAIN_TEST_LAUNCHER=torchrun starts agents there too). Traffic between hosts
crosses their interfaces, and the faults are the link's: a host cut off, a slow and lossy link. Needs root (CI runs as
root)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import HOSTS_PORT as PORT  # free on every host: each has a network stack of its own
from conftest import ROOT, child_env, run_dist, run_launched, run_python, run_torchrun

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests" / "dist"))
# common imports Lightning, which sets PYTORCH_NVML_BASED_CUDA_CHECK when imported: here, not in the first test, or
# the zygotes of its launch would take an environment the later tests' launches no longer have (they then use torchrun)
from common import reference_losses  # noqa: E402
from hosts import Hosts, HostsError, namespaces  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

NAME = "dttest"  # this file's hosts: dttest-h0, dttest-h1 and the switch dttest-sw


def on_hosts(hosts: Hosts, tmp_path: Path, spec: str, steps: int, per_host: int = 1,
             launcher: str | None = None) -> list[dict]:
    """tests/dist/multi_node.py on every host, ``per_host`` processes each: each rank's result. ``launcher``:
    "torchrun" for one torchrun agent per host, as docs/multi-node.md's command starts them."""
    return run_dist("multi_node.py", tmp_path, spec, str(steps), nproc=per_host * hosts.count, timeout=300,
                    hosts=hosts, launcher=launcher)


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Every agent's output, each asserted to have succeeded."""
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return outputs


def workers(hosts: Hosts, i: int) -> list[int]:
    """The processes torchrun's agent started on host ``i`` (disttrain's bootstrap), not the agent itself."""
    found = []
    for pid in hosts.pids(i):
        try:
            if b"_bootstrap.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # ended meanwhile
            pass
    return found


def results(out: Path, world_size: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world_size)]


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.fixture
def hosts():
    with Hosts(2, name=NAME) as made:
        yield made
    assert not [ns for ns in namespaces() if ns.startswith(NAME)]  # removed, also when the test failed


@pytest.mark.slow
def test_hybrid_sharding_across_two_hosts_shards_within_a_host_and_matches_one_process(hosts, tmp_path):
    """HSDP on 2 hosts x 2 processes: sharded within a host, replicated across; only the replicas' gradient
    all-reduce crosses the link (each host sends about one copy of the gradients per step). Launched as
    docs/multi-node.md's command does: `python -m torch.distributed.run --nnodes 2 --node-rank {rank}
    --nproc_per_node 2 --master_addr {main} --master_port 29500 tests/dist/multi_node.py ...` on each host."""
    steps = 3
    ranks = on_hosts(hosts, tmp_path, "disttrain_fsdp:hybrid_shard=true", steps, per_host=2, launcher="torchrun")
    assert [(r["node"], r["hostname"]) for r in ranks] == [(0, "host0"), (0, "host0"), (1, "host1"), (1, "host1")]
    assert ranks[0]["mesh"] == ["dp_replicate", "dp_shard"] and ranks[0]["shape"] == [2, 2]
    assert all(abs(r["local"] - r["total"] / 2) <= r["total"] * 0.01 for r in ranks)
    assert close(ranks[0]["losses"], reference_losses(steps, world_size=4))
    gradients = steps * ranks[0]["total"] * 4  # fp32 gradients of the whole model, per step
    for i in range(2):  # the all-gathers stayed inside the host: one gradient copy crossed, not several
        assert 0.8 * gradients < hosts.sent_bytes(i) < 2 * gradients, (i, hosts.sent_bytes(i), gradients)


@pytest.mark.slow
def test_tensor_parallel_within_a_host_and_data_parallel_across_matches_one_process(hosts, tmp_path):
    """disttrain_megatron tp=2 on each host's 2 processes, dp=2 across the hosts: the tensor-parallel all-reduces
    (every block, forward and backward) stay on a host, FSDP's traffic crosses."""
    steps = 3
    ranks = on_hosts(hosts, tmp_path, "disttrain_megatron:tensor_parallel_size=2", steps, per_host=2)
    assert [r["hostname"] for r in ranks] == ["host0", "host0", "host1", "host1"]
    assert ranks[0]["mesh"] == ["dp_shard", "tp"] and ranks[0]["shape"] == [2, 2]
    assert close(ranks[0]["losses"], reference_losses(steps, world_size=2))


@pytest.mark.slow
def test_a_slow_lossy_link_gives_the_same_losses(hosts, tmp_path):
    """50 ms +- 10 ms of delay and 1% loss on what each host sends (about 100 ms between hosts, retransmissions):
    the run is slower, its losses those of one process. The strategy is hybrid sharding with its default shard
    group, the processes of a host: one here, so each host holds a whole replica and only the gradient all-reduce
    crosses (the replicas once never met: each host trained its own model)."""
    for i in range(2):
        hosts.shape(i, delay_ms=50, jitter_ms=10, loss_percent=1)
    steps = 3
    start = time.monotonic()
    ranks = on_hosts(hosts, tmp_path, "disttrain_fsdp:hybrid_shard=true", steps)
    assert ranks[0]["mesh"] == ["dp_replicate", "dp_shard"] and ranks[0]["shape"] == [2, 1]
    assert all(r["local"] == r["total"] for r in ranks)  # a whole copy on each host
    for rank in ranks:
        assert close(rank["losses"], reference_losses(steps, world_size=2))
    assert time.monotonic() - start > 5  # the delay was there: hundreds of round trips of 100 ms


@pytest.mark.slow
def test_a_partitioned_host_ends_every_rank_within_the_timeout_naming_what_was_lost(hosts, tmp_path):
    """The demo under `disttrain run --timeout 10` on 2 hosts; host 1's cable is pulled mid-run. Host 0 names the
    silent rank and its host, host 1 the store it cannot reach (host 0's address), each in one line without a
    traceback, and both end within the timeout plus the watchdog's margin. (A store call to a cut-off host never
    returns: the watchdog bounds its own, or host 1 would end only when a collective gave up, later and without
    naming anything.)"""
    timeout = 10
    procs = [hosts.popen(i, [str(ROOT / ".venv/bin/disttrain"), "run", "--num-nodes", "2", "--node-rank", str(i),
                             "--main-address", hosts.main, "--accelerator", "cpu", "--devices", "1",
                             "--strategy", "disttrain_fsdp", "--timeout", str(timeout), "recipes/demo/tiny_llama.py",
                             "--steps", "100000", "--eval-every", "5", "--logger", "none", "--out",
                             str(tmp_path / f"host{i}")],
                         env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs: list[list[str]] = [[], []]
    readers = [threading.Thread(target=lambda i=i: outputs[i].extend(procs[i].stdout), daemon=True)
               for i in range(2)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 240
    while not any(line.startswith("step  10 ") for line in outputs[0]):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "".join(outputs[0])[-3000:]
        time.sleep(0.1)
    hosts.isolate(1)
    cut, ended = time.monotonic(), {}
    while len(ended) < 2 and time.monotonic() - cut < 6 * timeout:
        ended.update({i: time.monotonic() - cut for i, p in enumerate(procs) if i not in ended and p.poll() is not None})
        time.sleep(0.1)
    for reader in readers:
        reader.join(timeout=10)
    text = ["".join(lines) for lines in outputs]
    assert sorted(ended) == [0, 1] and max(ended.values()) <= 2 * timeout, (ended, text[1][-2000:])
    assert [p.returncode for p in procs] == [1, 1]
    assert re.search(r"disttrain run: error: disttrain_fsdp: rank 0: rank 1 \(pid \d+ on host1\) has not answered"
                     r" for \d+ s \(timeout 10 s\) while training", text[0]), text[0][-3000:]
    assert re.search(r"disttrain run: error: disttrain_fsdp: rank 1: the process group's store \(torchrun's agent"
                     r" at 10\.213\.0\.1:\d+\) has not answered for \d+ s \(timeout 10 s\)", text[1]), text[1][-3000:]
    assert "Traceback" not in text[0] + text[1]


@pytest.mark.slow
def test_a_lost_host_comes_back_and_the_run_resumes_from_the_last_checkpoint(hosts, tmp_path):
    """`disttrain run --max-restarts 1` on 2 hosts, a checkpoint after every step (on storage both hosts share); every
    process of host 1, its torchrun agent too, is SIGKILLed mid-run, and once host 0's process has ended on the loss,
    host 1's command is started again. Host 0's agent restarts its process, the new agent of host 1 joins it (a lost
    node replaced), both resume from the newest complete checkpoint, and the steps after it equal an uninterrupted
    run's. Host 0 says it restarted, and why.

    Host 1 comes back after host 0's agent has seen its process fail, as an operator's restart does: a new node that
    joins while the old process still runs is, to torchrun, a node added to a healthy run, whose processes it
    restarts without counting a restart (attempt 0, no line), which a launch quick enough can reach first."""
    out, ckpts, steps = tmp_path / "resumed", tmp_path / "ckpts", 6

    def start(i: int) -> subprocess.Popen:
        return hosts.popen(i, [str(ROOT / ".venv/bin/disttrain"), "run", "--num-nodes", "2", "--node-rank", str(i),
                               "--main-address", hosts.main, "--accelerator", "cpu", "--devices", "1",
                               "--strategy", "disttrain_fsdp", "--max-restarts", "1", "--timeout", "20",
                               "tests/dist/elastic_resume.py", str(out), str(ckpts), str(steps), "0", "0.5"],
                           env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first, lost = start(0), start(1)
    deadline = time.monotonic() + 240
    while not (ckpts / "step-000002").exists():
        assert time.monotonic() < deadline and first.poll() is None and lost.poll() is None, lost.communicate()[0]
        time.sleep(0.05)
    survivor = workers(hosts, 0)
    assert len(hosts.kill(1)) >= 2  # the agent and its process
    lost.wait(timeout=30)
    while set(survivor) & set(workers(hosts, 0)):  # ends on its next collective, within the 20 s timeout
        assert time.monotonic() < deadline and first.poll() is None, "host 0's process outlived the loss"
        time.sleep(0.05)
    back = time.monotonic()
    text = finish([first, start(1)], timeout=240)
    took = time.monotonic() - back
    ranks = results(out, 2)
    assert ranks[0]["start"] == ranks[1]["start"] >= 2, ranks  # resumed, not started over
    assert (ranks[0]["attempt"], ranks[1]["attempt"]) == (1, 0)  # host 0's agent restarted, host 1's is new
    assert close(ranks[0]["losses"], reference_losses(steps, world_size=2)[ranks[0]["start"]:])
    assert re.search(r"disttrain run: restart 1 of 1, after: ", text[0]), text[0][-3000:]
    assert took < 120, took


@pytest.mark.slow
def test_after_a_partition_the_same_commands_resume_from_the_last_complete_checkpoint(hosts, tmp_path):
    """The partition as the operator lives it, to the end: host 1's cable is pulled while the run checkpoints every
    step; both hosts end within the timeout (exit 1), no checkpoint is left half-written under its name, and once the
    cable is back the same two commands resume from the newest complete checkpoint; the steps after it equal an
    uninterrupted run's."""
    from disttrain.parallel.checkpoint.io import is_complete

    out, ckpts, steps, timeout = tmp_path / "run", tmp_path / "ckpts", 6, 10

    def start(i: int) -> subprocess.Popen:
        return hosts.popen(i, [str(ROOT / ".venv/bin/disttrain"), "run", "--num-nodes", "2", "--node-rank", str(i),
                               "--main-address", hosts.main, "--accelerator", "cpu", "--devices", "1",
                               "--strategy", "disttrain_fsdp", "--timeout", str(timeout),
                               "tests/dist/elastic_resume.py", str(out), str(ckpts), str(steps), "0", "0.5"],
                           env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = [start(0), start(1)]
    deadline = time.monotonic() + 240
    while not (ckpts / "step-000002").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in first), first[1].communicate()[0]
        time.sleep(0.05)
    hosts.isolate(1)
    cut = time.monotonic()
    outputs = [proc.communicate(timeout=6 * timeout)[0] for proc in first]
    assert time.monotonic() - cut <= 3 * timeout, outputs[1][-2000:]
    assert [p.returncode for p in first] == [1, 1], outputs[0][-2000:] + outputs[1][-2000:]
    assert not Path(f"{out}.0.json").exists()  # the partitioned run wrote no result
    named = [p for p in ckpts.iterdir() if not p.name.startswith(".")]
    assert named and all(is_complete(p) for p in named), sorted(p.name for p in ckpts.iterdir())
    hosts.reconnect(1)
    finish([start(0), start(1)], timeout=240)
    ranks = results(out, 2)
    assert ranks[0]["start"] == ranks[1]["start"] >= 2, ranks  # resumed, not started over
    assert close(ranks[0]["losses"], reference_losses(steps, world_size=2)[ranks[0]["start"]:])


@pytest.mark.slow
def test_zero3_across_two_hosts_matches_one_process(hosts, tmp_path):
    """disttrain_zero3 (DeepSpeed's engine) on 2 hosts x 1 process: each holds half of every parameter, the
    all-gathers and reduce-scatters cross the link, the losses are one process's."""
    steps = 3
    ranks = on_hosts(hosts, tmp_path, "disttrain_zero3", steps)
    assert [r["hostname"] for r in ranks] == ["host0", "host1"]
    assert all(abs(r["local"] - r["total"] / 2) <= r["total"] * 0.01 for r in ranks)
    assert close(ranks[0]["losses"], reference_losses(steps, world_size=2))
    parameters = steps * ranks[0]["total"] * 4  # fp32: each step gathers the half it lacks twice, reduces once
    assert all(hosts.sent_bytes(i) > parameters for i in range(2)), [hosts.sent_bytes(i) for i in range(2)]


@pytest.mark.slow
def test_the_daily_job_on_two_hosts_shards_its_tables_across_them(hosts, tmp_path):
    """The daily DeepFM job under torchrun on 2 hosts (one process each): torchrec shards the tables across the
    hosts, the job publishes one version holding both hosts' shards, with the metrics of the same job and layout on
    one machine (2 processes that each count as a node); the next day's run in one process warm-starts from it."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_recsys import RECIPE, records

    from disttrain.recsys.synthetic import make_days

    data = tmp_path / "data"
    make_days(data, 1, 6000)
    args = [str(RECIPE.relative_to(ROOT)), "--data-root", str(data), "--accelerator", "cpu"]
    procs = [hosts.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={i}",
                             "--nproc_per_node=1", f"--master_addr={hosts.main}", f"--master_port={PORT}", *args,
                             "--model-root", str(tmp_path / "hosts")],
                         env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    text = finish(procs)
    assert "published version 000001" in text[0], text[0][-3000:]
    version = tmp_path / "hosts" / "versions" / "000001"
    assert sorted(p.name for p in version.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert all(hosts.sent_bytes(i) > 1_000_000 for i in range(2))  # the ids' all-to-alls crossed the link
    # The same layout on one network stack: 2 processes that each see a node of their own (torchrec's planner lays
    # the tables out for the links between nodes, and a different plan initialises the tables differently).
    one_host = run_torchrun(*args, "--model-root", str(tmp_path / "one"), nproc=2, nodes=2, timeout=300)
    assert one_host.returncode == 0, one_host.stderr[-3000:]
    day = "2026-11-01"
    assert records(tmp_path / "hosts")[day]["metrics"] == records(tmp_path / "one")[day]["metrics"]
    make_days(data, 1, 6000, start=__import__("datetime").date(2026, 11, 2), first_index=1)
    next_day = run_python(*args, "--model-root", str(tmp_path / "hosts"), timeout=300)
    assert next_day.returncode == 0, next_day.stderr[-3000:]
    assert "current model 000001" in next_day.stdout and "published version 000002" in next_day.stdout


@pytest.mark.slow
def test_the_dialogue_recipe_trained_on_two_hosts_resumes_on_one_and_on_four(tmp_path):
    """recipes/nlp/dialogue_llm.py under `disttrain run` on 2 hosts, a checkpoint at step 2, resumed on 1 host and on
    4 (1 process each): the later steps see the same samples (the data position is carried over as the samples all
    ranks consumed) and give the uninterrupted run's losses and held-out loss. One row per micro-batch keeps the
    loss, a mean over micro-batches, the same however the global batch is split. The resumed runs' ranks are forked
    into the hosts with the variables `disttrain run` gives them (conftest.run_launched): the launcher on every host
    is the first run's."""
    from disttrain.nlp.corpus import demo_data

    demo = tmp_path / "demo"
    demo_data(demo)
    recipe = ["recipes/nlp/dialogue_llm.py", "--demo-root", str(demo), "--config", "configs/nlp/dialogue_demo.yaml",
              "--steps", "4", "--global-batch", "4", "--micro-batch", "1", "--log-every", "1", "--eval-every", "100",
              "--no-report"]

    def run(hosts: Hosts, count: int, out: Path, *extra: str) -> str:
        procs = [hosts.popen(i, [str(ROOT / ".venv/bin/disttrain"), "run", "--num-nodes", str(count), "--node-rank",
                                 str(i), "--main-address", hosts.main, "--accelerator", "cpu", "--devices", "1",
                                 "--strategy", "disttrain_fsdp", *recipe, "--out", str(out), *extra],
                             env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(count)]
        return finish(procs)[0]

    def resume(hosts: Hosts, count: int, out: Path, checkpoint: Path) -> str:
        proc = run_launched(*recipe, "--out", str(out), "--resume", str(checkpoint), devices=1,
                            strategy="disttrain_fsdp", hosts=hosts, nodes=count, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc.stdout + proc.stderr

    def losses(text: str) -> dict[str, str]:
        found = dict(re.findall(r"^step +(\d+)  train loss (\d+\.\d{6})$", text, re.M))
        found["held-out"] = re.findall(r"held-out loss (\d+\.\d+)  held-out perplexity (\S+)", text)[-1]
        return found

    with Hosts(4, name=NAME) as hosts:
        whole = losses(run(hosts, 2, tmp_path / "two", "--save-every", "2"))
        checkpoint = tmp_path / "two" / "checkpoints" / "step-000002"
        for count in (1, 4):
            text = resume(hosts, count, tmp_path / f"on{count}", checkpoint)
            assert f"resumed at step 2 (epoch 0, sample {8 // count} of this rank's share)" in text, text[-3000:]
            resumed = losses(text)
            assert sorted(resumed) == ["3", "4", "held-out"]
            assert resumed["held-out"] == whole["held-out"], (count, resumed, whole)
            for step in ("3", "4"):
                assert float(resumed[step]) == pytest.approx(float(whole[step]), abs=2e-6), (count, resumed, whole)
    assert not [ns for ns in namespaces() if ns.startswith(NAME)]


def test_the_harness_removes_what_an_earlier_killed_run_left(tmp_path):
    """A namespace left by a harness that was SIGKILLed is removed before new hosts are made, those of a live
    harness are not; the hosts run under their own hostnames, route to their link only, and a host's sending rate
    can be limited."""
    subprocess.run(["ip", "netns", "add", f"{NAME}-h7"], check=True)
    with Hosts(2, name=NAME) as made:
        assert f"{NAME}-h7" not in namespaces()
        with pytest.raises(HostsError, match=f"hosts named '{NAME}' are in use by another run"):
            Hosts(2, name=NAME).__enter__()  # a second harness of the name leaves these alone
        probe = "import socket; print(socket.gethostname())"
        names = [subprocess.run(made.command(i, [sys.executable, "-c", probe]), capture_output=True, text=True,
                                env=made.env(i)).stdout.strip() for i in range(2)]
        assert names == ["host0", "host1"]
        routes = subprocess.run(["ip", "-n", made.host(1), "-j", "route"], capture_output=True, text=True).stdout
        assert [r["dst"] for r in json.loads(routes)] == ["10.213.0.0/24"]  # no default route: nowhere else
        made.shape(1, rate_mbit=100)  # a slow link: a token bucket on what host 1 sends
        qdisc = subprocess.run(["ip", "netns", "exec", made.host(1), "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
    assert not [ns for ns in namespaces() if ns.startswith(NAME)]
