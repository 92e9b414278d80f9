"""Step time and bytes on the wire of the data-parallel strategies across 2 hosts joined by a slow link, with and
without gradient compression, in one run (needs root: the hosts are tools/hosts.py's network namespaces).

    sudo .venv/bin/python bench/multi_host.py                  # 200 Mbit/s link, Llama hidden 256 x 4 layers
    sudo .venv/bin/python bench/multi_host.py --rate-mbit 100  # a slower link
    sudo .venv/bin/python bench/multi_host.py --smoke          # tiny sizes, a few steps: checks the bench runs

What each host sends is limited to ``--rate-mbit`` (a token bucket on its interface), so that a step is bound by the
link, as it is between nodes whose network is slow next to their devices. Two layouts:

* 1 process per host (every byte a rank sends crosses the link): disttrain_ddp and disttrain_fsdp, fp32 and with
  ``gradient_compression`` (ddp: int8 and PowerSGD; fsdp: bf16 and int8).
* 2 processes per host: disttrain_fsdp sharded over all 4 ranks against HSDP (``hybrid_shard``: sharded within a
  host, replicated across, so only the replicas' gradient all-reduce crosses), and HSDP with bf16 gradients.

Each layout's processes then calibrate the hosts as ``disttrain calibrate`` does (its ``measure_here``, in the same
processes over the same link: the links within and between the hosts, and the model's own step), and the planner's
step time for each uncompressed plan is printed beside the measured one, with the plan it chooses (target: within 5%
of the fastest measured; median |error| <= 10%).

Printed per variant: the median step time and its speed-up over the layout's fp32 baseline of the same strategy
(target: int8 >= 1.5x where the link is the bottleneck), the bytes each host's interface sent per step (read from
the interface's counter, not computed) and, with 1 process per host, the bytes the strategy expects to cross
(gradients as the strategy counts them, plus FSDP's parameter all-gathers, computed from the model's size), with
their ratio (target: within 10%; the rest is TCP/IP headers, acknowledgements and the barriers between steps).
Last, the loss after ``--loss-steps`` steps of a small model with int8 gradients against fp32 (target: within 1%),
on the same link.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))
from harness import add_model_args, build_model, fork_ranks, parse_smoke  # noqa: E402
from tables import write_table  # noqa: E402

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
HOSTS = 2
PORT = 29500  # each host has a network stack of its own: free on all of them
# (layout: processes per host, variant name, strategy, options)
VARIANTS = [
    (1, "ddp", "disttrain_ddp", {}),
    (1, "ddp + int8", "disttrain_ddp", {"gradient_compression": "int8"}),
    (1, "ddp + PowerSGD", "disttrain_ddp", {"gradient_compression": "powersgd", "powersgd_start_iter": 2}),
    (1, "fsdp", "disttrain_fsdp", {}),
    (1, "fsdp + bf16", "disttrain_fsdp", {"gradient_compression": "bf16"}),
    (1, "fsdp + int8", "disttrain_fsdp", {"gradient_compression": "int8"}),
    (2, "ddp", "disttrain_ddp", {}),
    (2, "fsdp", "disttrain_fsdp", {}),
    (2, "HSDP", "disttrain_fsdp", {"hybrid_shard": True}),
    (2, "HSDP + bf16", "disttrain_fsdp", {"hybrid_shard": True, "gradient_compression": "bf16"}),
]
LOSS_VARIANTS = [("ddp", "disttrain_ddp", {}), ("ddp + int8", "disttrain_ddp", {"gradient_compression": "int8"})]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(batch=2, seq=64, rounds=1)
    p.add_argument("--rate-mbit", type=float, default=200.0, help="what each host may send, Mbit/s")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round (after 2 warm-up steps)")
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the loss comparison (int8 vs fp32)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds each layout may take")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the result file of a host's processes
    p.add_argument("--per-host", type=int, default=1, help=argparse.SUPPRESS)
    return parse_smoke(p, argv, hidden=64, layers=2, seq=32, batch=2, steps=2, loss_steps=4, rate_mbit=1000.0,
                       timeout=300)


# -- on the hosts ------------------------------------------------------------------------------------------------
def sent_bytes() -> int:
    """What this host's interface has sent (this process runs in the host's network namespace)."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def fabric_for(strategy: str, options: dict, per_host: int):
    import lightning as L

    import disttrain

    cls = {"disttrain_ddp": disttrain.fabric.DDPStrategy, "disttrain_fsdp": disttrain.fabric.FSDPStrategy}[strategy]
    fabric = L.Fabric(accelerator="cpu", devices=per_host, num_nodes=int(os.environ["WORLD_SIZE"]) // per_host,
                      strategy=cls(**options))
    fabric.launch()  # joins (the first time, creates) the process group
    return fabric


def data(args, steps: int) -> list[torch.Tensor]:
    """Batches, different on every rank, the same in every variant."""
    g = torch.Generator().manual_seed(100 + int(os.environ["RANK"]))
    return [torch.randint(0, 4096, (args.batch, args.seq), generator=g) for _ in range(steps)]


def timed(args, strategy: str, options: dict) -> dict:
    """One variant: median step seconds, this host's interface bytes and the strategy's gradient bytes per step."""
    fabric = fabric_for(strategy, options, args.per_host)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    warmup, times = 2, []
    batches = data(args, warmup + args.steps)
    for step, ids in enumerate(batches):
        fabric.barrier()
        if step == warmup:
            wire, counted = sent_bytes(), fabric.strategy.engine.comm_bytes()
        start = time.perf_counter()
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    after = fabric.strategy.engine.comm_bytes()
    wire = (sent_bytes() - wire) / args.steps
    return {"seconds": times, "wire": wire, "counted": None if after is None else (after - counted) / args.steps}


def losses(args, strategy: str, options: dict) -> list[float]:
    """``--loss-steps`` steps of a small model (hidden 64, 2 layers) from the same start: the global batch's loss."""
    import torch.distributed as dist

    fabric = fabric_for(strategy, options, args.per_host)
    small = argparse.Namespace(**{**vars(args), "hidden": 64, "layers": 2})
    model = build_model(small)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    # a fixed bigram chain over 96 tokens (each has a few likely successors): the loss settles at the chain's
    # entropy, so two runs' ends compare as learning, not as noise around a sudden drop
    transitions = torch.softmax(3 * torch.randn(96, 96, generator=torch.Generator().manual_seed(7)), dim=1)
    g = torch.Generator().manual_seed(7 + int(os.environ["RANK"]))
    out = []
    for _ in range(args.loss_steps):
        ids = torch.empty(args.batch, args.seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, 96, (args.batch,), generator=g)
        for t in range(1, args.seq):
            ids[:, t] = torch.multinomial(transitions[ids[:, t - 1]], 1, generator=g).squeeze(1)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        out.append(value.item() / dist.get_world_size())
    return out


def calibrate(args):
    """What ``disttrain calibrate`` measures, here on the layout's processes (every rank calls it): the collectives
    within and between the hosts, matmul, memory and, in a full run, the framework's overheads and the bench model's
    own step. The calibration is a full one (collectives at four sizes, nine times each); the smoke run's quick one
    fits a link through two sizes timed three times, whose spread moved DDP's prediction on 2 x 2 by 30% between
    runs. Measured in the processes that trained, with their threads: ``disttrain calibrate`` would start an agent
    and the ranks again on every host for the same figures."""
    from disttrain.planner.calibrate import measure_here

    models = [{"model": model_mapping(args), "micro_batch": args.batch, "seq_len": args.seq}]
    return measure_here(torch.device("cpu"), [], quick=args.smoke, models=models)


def result_path(folder: Path, per_host: int) -> Path:
    """Where a layout's rank 0 writes its results (the parent reads them)."""
    return folder / f"result{per_host}.json"


def calibration_path(result: str | Path) -> Path:
    """Where it writes its calibration, beside them."""
    return Path(result).with_suffix(".calibration.json")


def child(args) -> None:
    import torch.distributed as dist

    from disttrain.planner.calibrate import save

    results: dict = {"timed": {}, "losses": {}}
    for _ in range(args.rounds):
        for per_host, name, strategy, options in VARIANTS:
            if per_host == args.per_host:
                got = timed(args, strategy, options)
                mine = results["timed"].setdefault(name, {"seconds": [], "wire": [], "counted": got["counted"]})
                mine["seconds"] += got["seconds"]
                mine["wire"].append(got["wire"])
    if args.per_host == 1:
        for name, strategy, options in LOSS_VARIANTS:
            results["losses"][name] = losses(args, strategy, options)
    calibration = calibrate(args)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, {k: v["wire"] for k, v in results["timed"].items()})
    for name, mine in results["timed"].items():  # each host's median, from every host's first process
        mine["wire"] = [statistics.median(h[name]) for h in hosts[::args.per_host]]
    if dist.get_rank() == 0:
        save(calibration, calibration_path(args.child))
        Path(args.child).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent --------------------------------------------------------------------------------------------------
def threads(hosts, per_host: int) -> str:
    """Each process's OpenMP threads: the machine's cores shared by every host's processes (the hosts are one
    machine)."""
    return str(max(1, (os.cpu_count() or 2) // (hosts.count * per_host)))


def run_layout(hosts, argv: list[str], per_host: int, folder: Path, timeout: float) -> dict:
    """This script's processes on both hosts (one torchrun agent each), ``per_host`` processes per host; their
    output goes to ``folder`` and is shown when they fail or outlast ``timeout`` seconds. Under ``--smoke`` the
    ranks are forked from this process into the hosts instead (harness.fork_ranks)."""
    procs, logs, result = [], [], result_path(folder, per_host)
    child = [str(Path(__file__).resolve()), *argv, "--child", str(result), "--per-host", str(per_host)]
    env = {**os.environ, "OMP_NUM_THREADS": threads(hosts, per_host)}
    if "--smoke" in argv:
        ranks = [str(folder / f"host{r // per_host}-{per_host}.log") for r in range(hosts.count * per_host)]
        try:
            forked = fork_ranks(child, hosts.count * per_host, env, str(HERE.parent), False, hosts=hosts, logs=ranks,
                                port=PORT)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"multi_host: a rank failed (exit {e.returncode}):\n{Path(ranks[0]).read_text()[-6000:]}")
        if forked:
            return json.loads(result.read_text())
    for i in range(hosts.count):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts.count}", f"--node-rank={i}",
                   f"--nproc_per_node={per_host}", f"--master_addr={hosts.main}", f"--master_port={PORT}", *child]
        logs.append(folder / f"host{i}-{per_host}.log")
        with logs[-1].open("w") as log:
            procs.append(hosts.popen(i, command, env=env, cwd=str(HERE.parent), stdout=log,
                                     stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if any(proc.poll() not in (None, 0) for proc in procs):
            break
        time.sleep(0.2)
    failed = [i for i, proc in enumerate(procs) if proc.poll() not in (None, 0)]
    late = [i for i, proc in enumerate(procs) if proc.poll() is None]
    if failed or late:  # the host that failed first is the cause; the others' processes lost it
        shown = failed[0] if failed else late[0]
        state = f"failed (exit {procs[shown].returncode})" if failed else f"did not finish in {timeout:g} s"
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        raise SystemExit(f"multi_host: host {shown}'s processes {state}:\n{logs[shown].read_text()[-6000:]}")
    return json.loads(result.read_text())


def expected_bytes(args, name: str, counted: float | None, per_host: int) -> float | None:
    """What should cross the link per step from a host of the 1-process layout, where everything a rank sends does:
    the gradient bytes the strategy counted, plus, under FSDP, its two all-gathers of the fp32 parameters (a rank
    sends its half of each). None where the strategy does not count (PowerSGD) or ranks share a host (what crosses
    then depends on how the collectives route)."""
    if counted is None or per_host != 1:
        return None
    if name.startswith("fsdp"):
        with torch.device("meta"):
            parameters = sum(p.numel() for p in build_model(args).parameters()) * 4
        return counted + 2 * parameters / 2
    return counted


def model_mapping(args) -> dict:
    """The bench's model (harness.build_model) as the planner reads a config."""
    heads = max(4, args.hidden // 64)
    return {"model_type": "llama", "vocab_size": 4096, "hidden_size": args.hidden,
            "intermediate_size": int(args.hidden * 8 / 3) // 64 * 64, "num_hidden_layers": args.layers,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2, "max_position_embeddings": args.seq,
            "tie_word_embeddings": False}


def predictions(args, per_host: int, calibration: Path) -> tuple[dict[str, float], str]:
    """The planner's step time for the plans of a layout, from the calibration its processes measured over the same
    link (``calibrate``), and the plan it chooses among the uncompressed ones (disttrain_ddp and disttrain_fsdp,
    HSDP included)."""
    from disttrain.planner import calibrate as cal
    from disttrain.planner import choose, estimate, hardware, model_spec
    from disttrain.planner.steptime import breakdown

    mapping, world = model_mapping(args), HOSTS * per_host
    hw = cal.hardware_from(cal.load(calibration), hardware("cpu", gpus_per_node=per_host, host_memory=0))
    plan = choose(mapping, world, hw, micro_batch=args.batch, seq_len=args.seq,
                  precision="32-true", activation_checkpointing=False,
                  available={"disttrain_ddp", "disttrain_fsdp"})

    def name(candidate) -> str:
        if candidate.estimate.strategy == "disttrain_ddp":
            return "ddp"
        return "HSDP" if candidate.estimate.dims.dp_replicate > 1 else "fsdp"

    found = {name(c): c.step_time for c in plan.candidates if c.fits}
    # the compressed variants, which the planner never chooses by itself (they change the numerics): their
    # estimates' step times on the same calibration
    spec = model_spec(mapping)
    for per, variant, strategy, options in VARIANTS:
        if per == per_host and "+" in variant:
            hybrid = {"shard_size": per_host} if options.get("hybrid_shard") else {}
            e = estimate(spec, strategy, world, micro_batch=args.batch, seq_len=args.seq,
                         precision="32-true", **options, **hybrid)
            found[variant] = breakdown(spec, e, hw).total
    return found, name(plan.choice)


def main() -> None:
    args = parse_args()
    if args.child is not None:
        return child(args)
    if os.geteuid() != 0:
        raise SystemExit("multi_host: needs root (the hosts are network namespaces); run it with sudo")
    from hosts import Hosts

    argv = sys.argv[1:]
    results = {}
    with tempfile.TemporaryDirectory() as tmp, Hosts(HOSTS, name="dtbench") as hosts:
        for i in range(hosts.count):
            hosts.shape(i, rate_mbit=args.rate_mbit)
        for per_host in (1, 2):
            results[per_host] = run_layout(hosts, argv, per_host, Path(tmp), args.timeout)
            calibration = calibration_path(result_path(Path(tmp), per_host))
            results[per_host]["planned"] = predictions(args, per_host, calibration)
    rows = []
    for per_host, name, _, _ in VARIANTS:
        if name not in results[per_host]["timed"]:
            continue
        run = results[per_host]["timed"][name]
        base = results[per_host]["timed"]["ddp" if name.startswith("ddp") else "fsdp"]  # HSDP against fsdp
        ms, base_ms = statistics.median(run["seconds"]) * 1e3, statistics.median(base["seconds"]) * 1e3
        wire = statistics.mean(run["wire"])
        expected = expected_bytes(args, name, run["counted"], per_host)
        predicted = results[per_host]["planned"][0].get(name)
        rows.append([f"2 x {per_host}", name, ms, base_ms / ms, wire / 1e6,
                     None if expected is None else expected / 1e6, None if expected is None else wire / expected,
                     None if predicted is None else predicted * 1e3,
                     None if predicted is None else (predicted * 1e3 - ms) / ms * 100])
    setup = (f"2 hosts, link {args.rate_mbit:g} Mbit/s per host, cpu fp32, Llama hidden {args.hidden} x {args.layers}"
             f" layers, seq {args.seq}, batch {args.batch}/rank; {args.steps} steps x {args.rounds} rounds")
    columns = ["hosts x procs", "variant", "ms/step", "speed-up", "MB/step sent (interface)", "MB/step expected",
               "interface / expected", "planner ms", "planner error %"]
    print(f"data parallelism over a slow link ({setup}); targets: int8 >= 1.5x, interface within 10% of expected")
    print(" | ".join(columns))
    for r in rows:
        expected = "- | -" if r[5] is None else f"{r[5]:.2f} | {r[6]:.3f}"
        planned = "- | -" if r[7] is None else f"{r[7]:.0f} | {r[8]:+.0f}%"
        print(f"{r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.2f}x | {r[4]:.2f} | {expected} | {planned}")
    errors = sorted(abs(r[8]) for r in rows if r[8] is not None)
    for per_host in (1, 2):
        measured = {r[1]: r[2] for r in rows if r[0] == f"2 x {per_host}" and r[7] is not None and "+" not in r[1]}
        chosen = results[per_host]["planned"][1]
        fastest = min(measured, key=measured.get)
        print(f"2 x {per_host}: the planner chooses {chosen}, measured {measured[chosen] / measured[fastest] - 1:+.1%}"
              f" from the fastest uncompressed plan ({fastest}); target: within 5%")
    print(f"planner: median |error| {statistics.median(errors):.0f}% over {len(errors)} plans; target: <= 10%")
    final = {name: statistics.mean(values[-20:]) for name, values in results[1]["losses"].items()}
    base = final["ddp"]
    print(f"loss after {args.loss_steps} steps (mean of the last 20, a bigram chain's text; hidden 64 x 2 layers): "
          + ", ".join(f"{name} {value:.4f} ({value / base - 1:+.2%})" for name, value in final.items())
          + "; target: within 1%")
    write_table("multi_host", "Data parallelism across 2 hosts over a slow link", setup, columns, rows,
                bars=["speed-up"], fmt={"ms/step": ".0f", "speed-up": ".2f", "MB/step sent (interface)": ".2f",
                                        "MB/step expected": ".2f", "interface / expected": ".3f", "planner ms": ".0f",
                                        "planner error %": "+.0f"},
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
