"""The ``disttrain`` command and the ``lightning run model`` launcher.

Lightning 2.6 ships no ``lightning`` command, and ``fabric run`` freezes its ``--strategy`` choices when it is
imported (and hides every name containing "offload"), so it rejects ``disttrain_*`` names. This launcher accepts
every registered name and starts each process through a bootstrap that imports disttrain before the user's
script runs, so ``Fabric()`` in the script finds the strategy that ``LT_STRATEGY`` names.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from disttrain.ports import free_port, port_taken

BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
DEFAULT_PORT = 29400  # torchrun's default rendezvous port
PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "bf16-true", "16-mixed", "16", "16-true", "64-true", "64")


def _launcher_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Launch a Lightning Fabric script on several processes (torchrun underneath). Options after"
                    " SCRIPT that are not listed here are passed to the script; put the script's own options"
                    " after `--` if their names clash with these.")
    parser.add_argument("script", help="path to the Python script to run")
    parser.add_argument("--accelerator", default=None, choices=("cpu", "gpu", "cuda", "mps", "auto"))
    parser.add_argument("--strategy", default=None, help="a registered strategy name, e.g. disttrain_fsdp")
    parser.add_argument("--devices", default="1", help="processes per node: a number, 'auto', or a list '0,1'")
    parser.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=1)
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0)
    parser.add_argument("--main-address", "--main_address", dest="main_address", default="127.0.0.1")
    parser.add_argument("--main-port", "--main_port", dest="main_port", type=int, default=None,
                        help=f"the rendezvous port on --main-address (default {DEFAULT_PORT}; on one node a free port"
                             " when that one is taken)")
    parser.add_argument("--precision", default=None, choices=PRECISIONS)
    parser.add_argument("--timeout", default=None, type=float, metavar="SECONDS",
                        help="a process silent this long (stopped, hung) ends the run on every rank, and a collective"
                        " waits a few seconds more (sets DISTTRAIN_TIMEOUT for the strategies; default 600)")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                        help="restart all processes this many times when one fails (torchrun's elastic restarts);"
                             " the script resumes from its newest complete checkpoint")
    parser.add_argument("--verbose", action="store_true",
                        help="show every process's traceback and torchrun's report when the run fails (default: a"
                             " failure with a one-line description, such as strategy sizes the devices cannot hold,"
                             " is that line alone; also DISTTRAIN_VERBOSE=1)")
    return parser


def _num_processes(accelerator: str | None, devices: str) -> int:
    import torch

    gpu = accelerator in ("gpu", "cuda") or (accelerator in (None, "auto") and torch.cuda.is_available())
    if devices in ("auto", "-1"):
        return torch.cuda.device_count() if gpu else 1
    if "," in devices or devices.startswith("["):
        return len([d for d in devices.strip("[]").split(",") if d.strip()])
    try:
        count = int(devices)
    except ValueError:
        raise SystemExit(f"--devices={devices!r} is not a number, 'auto' or a list like '0,1'") from None
    if count < 1:
        raise SystemExit(f"--devices={count} must be at least 1")
    return count


def rendezvous_port(main_port: int | None, num_nodes: int = 1, node_rank: int = 0, max_restarts: int = 0,
                    prog: str = "disttrain run", default: int = DEFAULT_PORT) -> int:
    """The port the launcher's rendezvous uses: ``main_port`` as given (None: ``default``), checked on the machine
    that hosts the store. On one node a taken default is replaced by a free port (said on stderr); a taken port
    the user chose, or any taken port with several nodes (they must all agree on it), ends the launch in one line."""
    port = default if main_port is None else main_port
    # The store's host: the only node with one node; node rank 0 under the static rendezvous. With --max-restarts
    # on several nodes, torchrun's c10d rendezvous lets an agent that finds the port taken on the main address's
    # machine join as a client (two agents on one machine): that case is torchrun's.
    hosts_store = num_nodes == 1 or (max_restarts == 0 and node_rank == 0)
    if not hosts_store or not port_taken(port):
        return port
    suggestion = free_port()
    if num_nodes > 1:
        raise SystemExit(f"{prog}: error: port {port} is in use on this node (node rank 0 hosts the rendezvous), and"
                         f" all {num_nodes} nodes must use the same port: pass --main-port {suggestion} (free here)"
                         " or another free port to every node")
    if main_port is not None:
        raise SystemExit(f"{prog}: error: --main-port {port} is in use on this machine (another run or program"
                         f" listens on it): pass a free port (--main-port {suggestion} is free now) or leave"
                         " --main-port out to get one")
    print(f"{prog}: port {port} (the default --main-port) is in use; using free port {suggestion}", file=sys.stderr)
    return suggestion


def check_strategy_name(name: str, prog: str) -> None:
    """Exit with one line unless ``name`` is a registered strategy. A disttrain name is checked against disttrain's
    registry; any other against Lightning's (which then holds disttrain's too), imported only for such a name: the
    launcher itself needs nothing of Lightning, whose import takes seconds of every launch's start."""
    from disttrain.parallel.registry import closest_names, names

    if name in names():
        return
    import disttrain  # noqa: F401  (registers disttrain's names in Lightning's registry when it is first read)
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if name in STRATEGY_REGISTRY:
        return
    available = STRATEGY_REGISTRY.available_strategies()
    close = closest_names(name, available, n=2)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise SystemExit(f"{prog}: error: --strategy {name!r} is not a registered strategy; {hint}choose one of:"
                     f" {', '.join(sorted(available))}")


def launch(argv: list[str], prog: str = "disttrain run", default_port: int = DEFAULT_PORT) -> int:
    """Parse launcher options, set Fabric's LT_* variables and run torchrun on the bootstrap (``default_port``:
    the rendezvous port when ``--main-port`` is not given)."""
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args, unknown = _launcher_parser(prog).parse_known_args(argv)
    script_args = unknown + script_args
    if not Path(args.script).is_file():
        raise SystemExit(f"script {args.script!r} does not exist; pass the path of a Python file")
    if args.strategy is not None:
        check_strategy_name(args.strategy, prog)
    nproc = _num_processes(args.accelerator, args.devices)
    port = rendezvous_port(args.main_port, args.num_nodes, args.node_rank, args.max_restarts, prog, default_port)

    os.environ["LT_CLI_USED"] = "1"
    os.environ["LT_DEVICES"] = str(args.devices)
    os.environ["LT_NUM_NODES"] = str(args.num_nodes)
    for name, value in (("LT_ACCELERATOR", args.accelerator), ("LT_STRATEGY", args.strategy),
                        ("LT_PRECISION", args.precision)):
        if value is not None:
            os.environ[name] = value
    if args.timeout is not None:
        if not args.timeout > 0:
            raise SystemExit(f"--timeout {args.timeout:g} must be a positive number of seconds (e.g. 600)")
        os.environ["DISTTRAIN_TIMEOUT"] = f"{args.timeout:g}"
    # One OpenMP thread per process unless the user chose: N processes x all cores oversubscribes the CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    from torch.distributed import run as torchrun

    from disttrain.parallel.guards.reports import VERBOSE_ENV, verbose

    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # the processes let their tracebacks through too
    if args.max_restarts > 0:
        # Restarts need a rendezvous that every node's agent can join again after a failure: c10d (the static one
        # only fits a fixed set of processes). Each attempt's processes get a store of their own, hosted by their
        # rank 0 on a free port the rendezvous announces: the store torchrun's agents share otherwise outlives the
        # failed attempt's keys, and an agent that replaces a lost node never learns its address (torchrun's rank-0
        # agent announces it in the first round only, so the newcomer's rendezvous fails reading it).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.main_address}:{port}",
                      f"--rdzv-id=disttrain-{port}", f"--max-restarts={args.max_restarts}"]
    else:
        rendezvous = [f"--node_rank={args.node_rank}", f"--master_addr={args.main_address}", f"--master_port={port}"]
    argv = [f"--nproc_per_node={nproc}", f"--nnodes={args.num_nodes}", *rendezvous, str(BOOTSTRAP), args.script,
            *script_args]
    if verbose():
        torchrun.main(argv)
        return 0
    with one_line_reports() as reports:
        try:
            torchrun.main(argv)
        except Exception:
            line = reports.first()
            if line is None:
                raise
            print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
            return 1
    return 0


def leave_report(error: BaseException) -> bool:
    """In a launched process (the bootstrap), for a failure of the user's script: leave its one line
    (``parallel.guards.failures.describe``) in the launcher's folder (``attempt<A>.rank<N>.txt``); whether it did
    (not for a failure with no one-line description, nor under ``DISTTRAIN_VERBOSE=1``)."""
    from disttrain.parallel.guards import reports
    from disttrain.parallel.guards.failures import describe, verbose

    line = None if verbose() or not os.environ.get(reports.REPORT_ENV) else describe(error)
    return line is not None and reports.leave(line)


class Reports:
    """The folder where the processes leave their one-line failures (:func:`leave_report`), by rank."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def first(self) -> str | None:
        """The line of the lowest rank that left one (None: no process did)."""
        from disttrain.parallel.guards import reports

        return reports.first(self.folder)


class AfterReport(logging.Filter):
    """Drops torchrun's records once a process has left its line: the signal it sends the other processes and the
    failure it logs are the consequence of that line, which the launcher prints."""

    def __init__(self, reports: Reports) -> None:
        super().__init__()
        self.reports = reports

    def filter(self, record: logging.LogRecord) -> bool:
        return self.reports.first() is None


# torchrun's loggers that report a failed process (the signal to the others, the exit codes).
TORCHRUN_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


@contextmanager
def one_line_reports() -> Iterator[Reports]:
    """A fresh folder for the processes' one-line failures (``$DISTTRAIN_LAUNCH_REPORTS``) and torchrun's failure
    records quiet after one arrives, for the duration of a launch."""
    from disttrain.parallel.guards.reports import REPORT_ENV

    with tempfile.TemporaryDirectory(prefix="disttrain-run-") as folder:
        reports = Reports(Path(folder))
        quiet = AfterReport(reports)
        loggers = [logging.getLogger(name) for name in TORCHRUN_LOGGERS]
        os.environ[REPORT_ENV] = folder
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            yield reports
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
            os.environ.pop(REPORT_ENV, None)


def _export(argv: list[str]) -> int:
    from disttrain.parallel.checkpoint.export import FORMATS, export_checkpoint

    parser = argparse.ArgumentParser(prog="disttrain export", description="Consolidate a sharded checkpoint folder"
                                     " of any disttrain strategy into the model's full weights (one process).")
    parser.add_argument("checkpoint", help="checkpoint folder written by a disttrain strategy")
    parser.add_argument("output", help="what to write: a .safetensors file, an HF directory (--to hf), a state dict"
                                       " file (--to timm / torch)")
    parser.add_argument("--to", default="safetensors", choices=FORMATS,
                        help="hf: config.json + model.safetensors; timm: a state dict timm loads (.safetensors or"
                             " .pth); torch: a torch.save state dict; safetensors (default): one file")
    parser.add_argument("--config", default=None, help="--to hf: the model's config.json or a directory holding it"
                                                       " (default: the 'hf_config' saved in the checkpoint)")
    parser.add_argument("--key", default=None, help="the model's entry (Trainer checkpoints: 'state_dict')")
    parser.add_argument("--prefix", default="", help="keep only keys under this prefix and strip it, e.g. 'model.'")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.to, args.output, key=args.key, prefix=args.prefix,
                            config=args.config)
    print(f"wrote {out}")
    return 0


def _verify(argv: list[str]) -> int:
    from disttrain.parallel.checkpoint.integrity import MANIFEST_FILE, checkpoint_problems, read_manifest

    parser = argparse.ArgumentParser(prog="disttrain verify", description="Check checkpoint folders offline against"
                                     f" their {MANIFEST_FILE} (a checksum of every file) and DCP's metadata. Prints one"
                                     " line per problem; exit 0 when every folder verifies, 1 otherwise.")
    parser.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoint folder(s) written by disttrain")
    args = parser.parse_args(argv)
    failed = False
    for folder in args.checkpoints:
        problems = checkpoint_problems(folder)
        for problem in problems:
            print(problem)
        failed = failed or bool(problems)
        if not problems:
            manifest = read_manifest(folder)
            if manifest is None:
                print(f"{folder}: no {MANIFEST_FILE} (written before disttrain stored checksums): its structure is"
                      " sound, its contents cannot be verified")
            else:
                size = sum(entry["bytes"] for entry in manifest["files"].values())
                print(f"{folder}: ok ({len(manifest['files'])} files, {size / 2**20:.1f} MiB, {manifest['hash']})")
    return 1 if failed else 0


def _strategies(argv: list[str]) -> int:
    from disttrain.parallel.registry import STRATEGIES

    width = max(len(row.name) for row in STRATEGIES)
    for row in STRATEGIES:
        print(f"{row.name:<{width}}  {row.description}")
    return 0


def _plan(argv: list[str]) -> int:
    from disttrain.planner import PRESETS, choose

    parser = argparse.ArgumentParser(prog="disttrain plan", description="Estimate per-rank memory of every strategy"
                                     " for a model on a machine, and recommend one (no model is allocated).")
    parser.add_argument("--model", required=True, help="recipe YAML with a top-level `model:` mapping, an HF model"
                        " folder or its config.json (any family), or a timm model name (e.g. resnet18)")
    parser.add_argument("--gpus", type=int, required=True, help="number of devices (all nodes)")
    parser.add_argument("--gpu-mem", default=None, help="memory per device, e.g. 40GiB (default: the preset's)")
    parser.add_argument("--gpu", default=None, help=f"device preset for bandwidths and FLOP/s: {', '.join(PRESETS)}")
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per device between nodes")
    parser.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s per device inside a node (NVLink,"
                        " or PCIe where there is none)")
    parser.add_argument("--micro-batch", type=int, default=None, help="samples per device per step (default: the"
                        " recipe's train.micro_batch_size / data.batch_size, else the largest that fits)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the recipe's"
                        " data.seq_len, else the model's)")
    parser.add_argument("--precision", default=None, help="default: the recipe's train.precision, else bf16-mixed")
    parser.add_argument("--activation-checkpointing", default=None, choices=("on", "off"),
                        help="default: the recipe's train.activation_checkpointing, else both are estimated")
    parser.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank on a frozen"
                        " model (default: the recipe's lora.rank, else 0: the whole model trains)")
    parser.add_argument("--trial", action="store_true", help="run a few steps of each of the best --trial-top plans"
                        " on this machine's devices (--gpus processes) and recommend the fastest measured")
    parser.add_argument("--trial-top", type=int, default=3, metavar="K", help="plans to try (default 3)")
    parser.add_argument("--trial-steps", type=int, default=3, help="timed steps per plan (after one warm-up)")
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free")
    parser.add_argument("--simulate", action="store_true", help="also shard the model with the recommended strategy"
                        " on a fake process group and show the simulated model states beside the estimate")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw per-rank memory per strategy against"
                        " the usable device memory into this PNG")
    args = parser.parse_args(argv)
    overrides = {}
    if args.gpus_per_node:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.inter_node_gbps:
        overrides["inter_node_bw"] = args.inter_node_gbps * 1e9
    if args.intra_node_gbps:
        overrides["intra_node_bw"] = args.intra_node_gbps * 1e9
    from disttrain.planner import hardware
    from disttrain.planner.hardware import present

    here = here_device(args.gpu, args.gpus, args.gpus_per_node)
    if args.trial and here is None:
        named = f"--gpu {args.gpu}" if args.gpu else "the default (A100-class) hardware"
        raise ValueError(f"--trial runs the plans on this machine's devices, and {named} with --gpus {args.gpus} is"
                         " not what is here: pass --gpu cpu (CPU processes) or --gpu cuda (this machine's GPUs)")
    if here is not None:  # the devices here: calibrated (measured now, once, when not cached)
        hw = present(here, args.gpus, memory=args.gpu_mem, **overrides)
    else:
        hw = hardware(args.gpu, args.gpu_mem, **overrides)
    ac = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
    plan = choose(args.model, args.gpus, hw, micro_batch=args.micro_batch, seq_len=args.seq_len,
                  precision=args.precision, headroom=args.headroom, activation_checkpointing=ac,
                  lora_rank=args.lora_rank)
    if args.trial:
        from disttrain.planner.trial import trial

        trial(plan, args.model, top=args.trial_top, steps=args.trial_steps)
    print(plan.report())
    if args.plot:
        _plan_plot(plan, args.plot)
    if args.simulate:
        _plan_simulation(args.model, plan, (plan.choice or plan.candidates[0]).estimate.precision)
    return 0 if plan.choice is not None else 1


def here_device(gpu: str | None, count: int, per_node: int | None = None) -> str | None:
    """"cpu" or "cuda" when ``--gpu`` names this machine's devices (``cpu``; ``cuda`` or no ``--gpu`` with that many
    GPUs here), else None: a preset for hardware that is not here. ``--gpu cuda`` with ``per_node`` (--gpus-per-node)
    GPUs here and ``count`` a multiple of it: a cluster of nodes like this one."""
    import torch

    if gpu is not None and gpu.lower() == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (gpu is None or gpu.lower() == "cuda") and 0 < count <= gpus:
        return "cuda"
    if gpu is not None and gpu.lower() == "cuda":
        if per_node and 0 < per_node <= gpus and count % per_node == 0:
            return "cuda"
        raise ValueError(f"--gpu cuda: this machine has {gpus} GPUs, --gpus {count} asks for more; pass"
                         " --gpus-per-node to plan for nodes like this one, or a preset (--gpu A100) to plan for"
                         " hardware that is not here")
    return None


def _calibrate(argv: list[str]) -> int:
    from disttrain.planner.calibrate import cache_path, calibrate, model_shapes

    parser = argparse.ArgumentParser(prog="disttrain calibrate", description="Measure this machine for the planner:"
                                     " matmul throughput (at a model's shapes with --model), memory and optimizer"
                                     " bandwidth, and each collective's latency and bandwidth over --devices processes"
                                     " (gloo on CPU, nccl on GPUs); cached per host, device and process count.")
    parser.add_argument("--devices", type=int, required=True, help="processes (one per GPU)")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda", "gpu"))
    parser.add_argument("--model", default=None, help="also time the matmuls of this model (a recipe YAML, HF"
                        " config or timm name) at --micro-batch, and (a recipe YAML or HF config) its own forward and"
                        " backward")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's, else 1")
    parser.add_argument("--force", action="store_true", help="measure again even when the cache holds a result")
    parser.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=1,
                        help="nodes to measure over, --devices processes on each: run the same command on every node"
                        " with its --node-rank; the links within a node and between nodes are measured (always"
                        " measured anew: a node cannot know whether the others hold the result)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        help="this node's rank, 0 to --num-nodes - 1 (node 0 hosts the rendezvous)")
    parser.add_argument("--main-address", "--main_address", dest="main_address", default=None,
                        help="the address of node rank 0's machine (needed with --num-nodes > 1)")
    parser.add_argument("--main-port", "--main_port", dest="main_port", type=int, default=None,
                        help=f"the rendezvous port there, the same on every node (default {DEFAULT_PORT})")
    parser.add_argument("--quick", action="store_true", help="the links, matmul and memory only, at fewer sizes, once"
                        " each: a check of the set-up and its links in seconds (rough figures; the framework's"
                        " overheads and --model timings stay the preset's; cached like a full calibration)")
    args = parser.parse_args(argv)
    if args.devices < 1:
        raise ValueError(f"--devices {args.devices} must be at least 1 (processes per node)")
    if args.num_nodes < 1:
        raise ValueError(f"--num-nodes {args.num_nodes} must be at least 1")
    if not 0 <= args.node_rank < args.num_nodes:
        raise ValueError(f"--node-rank {args.node_rank} needs --num-nodes {args.node_rank + 1} or more (one node is"
                         " node rank 0)" if args.num_nodes == 1 and args.node_rank > 0 else
                         f"--node-rank {args.node_rank} is not one of the --num-nodes {args.num_nodes} nodes' ranks:"
                         f" pass 0 to {args.num_nodes - 1}, 0 on the machine at --main-address")
    if args.num_nodes > 1 and not args.main_address:
        raise ValueError(f"--num-nodes {args.num_nodes} needs --main-address: the address of node rank 0's machine,"
                         " the same on every node")
    if args.main_port is not None and not 0 < args.main_port < 65536:
        raise ValueError(f"--main-port {args.main_port} is not a port (1 to 65535)")
    import torch

    device = torch.device("cuda" if args.accelerator in ("cuda", "gpu") else "cpu")
    path = cache_path(device, args.devices * args.num_nodes, nodes=args.num_nodes)
    shapes: list = []
    models: list = []
    if args.model:
        from disttrain.planner import model_spec
        from disttrain.planner.spec import recipe_model

        spec = model_spec(args.model)
        recipe = spec.extra.get("recipe", {})
        micro_batch = args.micro_batch or recipe.get("micro_batch", 1)
        seq_len = recipe.get("seq_len") or spec.tokens or 1
        shapes = model_shapes(spec, micro_batch, seq_len)
        source = Path(args.model)
        if source.suffix in (".yaml", ".yml"):
            mapping = recipe_model(source)
        elif source.is_dir() or source.suffix == ".json":  # an HF config: built from its model_type and keys
            from disttrain.planner.generic import read_hf_config

            mapping = read_hf_config(source).to_dict()
        else:
            mapping = None
            print(f"{args.model}: its own step is not timed (a recipe YAML's or an HF config's model is)")
        if mapping is not None:
            models = [{"model": mapping, "micro_batch": micro_batch, "seq_len": seq_len}]
    # Over several nodes every launch measures: one that stopped at its cache would leave the others waiting.
    if path.exists() and not args.force and not shapes and args.num_nodes == 1:
        from disttrain.planner.calibrate import load

        load(path)  # a corrupt file is one error naming it
        print(f"{path}: already calibrated (--force measures again)")
        return 0
    c = calibrate(args.devices, args.accelerator, shapes, path=path, models=models, quick=args.quick,
                  num_nodes=args.num_nodes, node_rank=args.node_rank, main_address=args.main_address,
                  main_port=args.main_port)
    print(f"wrote {path}")
    print(f"matmul {max(r[3] for r in c.matmul) / 1e9:.3g} GFLOP/s at best; memory {c.memory_bw / 1e9:.3g} GB/s;"
          f" AdamW sweeps {c.optimizer_bw / 1e9:.3g} GB/s; overlap {c.overlap:.2f}")
    tables = [("", c.links)] if c.inter_links is None else \
        [(f"within a node ({c.per_node} processes):", c.links), (f"between nodes ({c.nodes}):", c.inter_links)]
    for title, links in tables:
        if title:
            print(title)
        for op, link in links.items():
            print(f"{op:<15} latency {link.latency * 1e6:9.1f} us  bandwidth {link.bandwidth / 1e9:8.3g} GB/s"
                  " per rank")
    timed = c.models or []
    for row in timed[len(timed) - len(models):]:  # the models measured now come last
        steps = ", ".join(f"{d} blocks {t * 1e3:.1f} ms" for d, t in zip(row["depths"], row["seconds"]))
        print(f"model {row['name']} forward + backward of {row['micro_batch']} x {row['seq_len']}: {steps}")
    return 0


def _plan_simulation(model: str, plan, precision: str) -> None:
    """``plan --simulate``: the recommendation (else the candidate needing the least memory) simulated."""
    from disttrain.simulate import simulate, versus

    candidate = plan.choice or min(plan.candidates, key=lambda c: c.estimate.device)
    e = candidate.estimate
    sim = simulate(model, e.strategy, e.world_size, precision=precision, **e.options)
    print(f"\nsimulated: {candidate.label} (the real sharding code on a fake process group)\n")
    print(versus(sim, e))


def degree_flags() -> dict[str, str]:
    """``disttrain simulate``'s degree flags (``--tp``...): the options that set a degree, by dimension, of every
    registered strategy's options (``MegatronOptions.degrees``); the strategy turns them into degrees."""
    from disttrain.parallel.registry import STRATEGIES

    return {dim: option for row in STRATEGIES for dim, option in getattr(row.options_cls, "degrees", {}).items()}


def _simulate(argv: list[str]) -> int:
    from disttrain.simulate import simulate, simulated

    parser = argparse.ArgumentParser(prog="disttrain simulate", description="Shard a recipe's model with a strategy"
                                     " on a fake process group of --world-size ranks (one process, meta tensors: no"
                                     " memory is allocated) and print what each rank role holds.")
    parser.add_argument("--model", required=True, help="recipe YAML with a top-level `model:` mapping")
    parser.add_argument("--strategy", required=True, choices=simulated())
    parser.add_argument("--world-size", type=int, required=True, help="ranks to simulate, e.g. 32 or 1024")
    for dim, option in degree_flags().items():
        parser.add_argument(f"--{option.replace('_', '-')}", f"--{dim}", dest=option, type=int, default=None,
                            help=f"the {option} option ({dim} in the degrees)")
    parser.add_argument("--hybrid-shard-size", type=int, default=None,
                        help="disttrain_fsdp with hybrid_shard=True: ranks per shard group")
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args(argv)
    options = {option: getattr(args, option) for option in degree_flags().values() if getattr(args, option)}
    if args.hybrid_shard_size is not None:
        options.update(hybrid_shard=True, shard_size=args.hybrid_shard_size)
    try:
        sim = simulate(args.model, args.strategy, args.world_size, precision=args.precision, **options)
    except TypeError as e:  # a degree flag the strategy has no option for
        raise ValueError(str(e)) from None
    print(sim.table())
    return 0


def _report(argv: list[str]) -> int:
    """``disttrain report RUN_DIR``: redraw a recipe run's report.png/report.md from its logs (also of an interrupted
    run), or the daily job's model history when RUN_DIR is its --model-root."""
    parser = argparse.ArgumentParser(prog="disttrain report", description=_report.__doc__)
    parser.add_argument("run_dir", help="a recipe's --out folder, or the daily job's --model-root")
    args = parser.parse_args(argv)
    from disttrain.report import write_report
    from disttrain.report.daily import is_daily_root, write_history_report

    png, md = (write_history_report if is_daily_root(args.run_dir) else write_report)(args.run_dir)
    print(f"wrote {png} and {md}")
    return 0

def _plan_plot(plan, path: str) -> None:
    from disttrain.planner.plot import save_plan_plot

    try:
        print(f"wrote {save_plan_plot(plan, path)}")
    except OSError as e:
        raise SystemExit(f"disttrain plan: error: cannot write --plot {path}: {e.strerror or e}; choose a writable"
                         " path") from None


def _recsys(argv: list[str]) -> int:
    """``disttrain recsys make-data|daily|materialize ...``: the demo data generator, the daily DeepFM job and the
    rebuilding of a delta version as a full one."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: disttrain recsys make-data OUT_DIR [--days N --rows R --start YYYY-MM-DD --seed S --every 1h]\n"
              "       disttrain recsys daily --data-root DIR --model-root DIR [--run-date YYYY-MM-DD[_HH]]"
              " [--every 1d|1h] [--full] [--force]\n"
              "       disttrain recsys materialize VERSION --model-root DIR [--out DIR]")
        return 0
    if argv[0] == "daily":
        from disttrain.recsys.daily import main as daily_main

        return daily_main(argv[1:], prog="disttrain recsys daily")
    if argv[0] == "materialize":
        return _materialize(argv[1:])
    if argv[0] != "make-data":
        raise ValueError(f"unknown recsys command {argv[0]!r}; use make-data, daily or materialize")
    from disttrain.recsys.data import parse_date
    from disttrain.recsys.synthetic import make_days

    parser = argparse.ArgumentParser(prog="disttrain recsys make-data", description="Write Criteo-format days"
                                     " (day_YYYY-MM-DD.tsv) drawn from a planted ground-truth model with daily drift.")
    parser.add_argument("out", help="folder to write the day files into")
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--rows", type=int, default=50000, help="rows per day")
    parser.add_argument("--start", type=parse_date, default=parse_date("2026-11-01"), help="date of the first day")
    parser.add_argument("--first-index", type=int, default=0,
                        help="drift steps before the first day (continue an earlier call: its --days count)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the planted model")
    parser.add_argument("--drift", type=float, default=0.05, help="daily drift of the planted model")
    parser.add_argument("--bad-rows", type=int, default=0, help="malformed rows mixed into each day")
    parser.add_argument("--every", choices=("1d", "1h"), default="1d",
                        help="1h: --days hour files day_YYYY-MM-DD_HH.tsv from --start 00:00 on (default: 1d)")
    args = parser.parse_args(argv[1:])
    for path in make_days(args.out, args.days, args.rows, start=args.start, seed=args.seed, drift=args.drift,
                          bad_rows=args.bad_rows, first_index=args.first_index, every=args.every):
        print(f"wrote {path}")
    return 0


def _materialize(argv: list[str]) -> int:
    """``disttrain recsys materialize VERSION --model-root DIR [--out DIR]``: a delta version and the versions it
    is built on, as one full version folder."""
    from disttrain.recsys.delta import DeltaError, materialize
    from disttrain.recsys.publish import StoreError

    parser = argparse.ArgumentParser(prog="disttrain recsys materialize", description="Rebuild a published version"
                                     " (its full base + the deltas up to it) as one full model folder, loadable as"
                                     " any full version. One process, no GPU.")
    parser.add_argument("version", help="the version's folder name under MODEL_ROOT/versions, e.g. 000007")
    parser.add_argument("--model-root", required=True, type=Path, help="the daily job's --model-root")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write it (default: MODEL_ROOT/materialized/VERSION); must not exist")
    args = parser.parse_args(argv)
    out = args.out or args.model_root / "materialized" / args.version
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {materialize(args.model_root, args.version, out)}")
    except (DeltaError, StoreError, FileExistsError, PermissionError) as e:
        print(f"disttrain recsys materialize: error: {e}", file=sys.stderr)
        return 1
    return 0


USAGE = """usage: disttrain COMMAND ...

commands:
  run SCRIPT [--strategy NAME --devices N --accelerator cpu|gpu --precision P --num-nodes N
             --max-restarts N ...] [script args]
                 launch a Fabric script on N processes per node (same as `lightning run model`)
  export CHECKPOINT OUTPUT [--to safetensors|hf|timm|torch] [--config CONFIG] [--key state_dict] [--prefix model.]
                 consolidate a checkpoint folder of any strategy into one safetensors file, an HF directory,
                 a timm or a plain torch state dict
  verify CKPT [CKPT ...]
                 check checkpoint folders offline against their checksums (exit 0: all sound; one line per problem)
  strategies     list the registered disttrain strategy names
  calibrate --devices N [--accelerator cpu|cuda --model CONFIG --force --num-nodes M --node-rank R
             --main-address ADDR --main-port P]
                 measure this machine for the planner (matmul, memory, collectives over N processes; with
                 --num-nodes, run on every node: the links within and between nodes); cached
  plan --model CONFIG.yaml|HF_DIR|TIMM_NAME --gpus N [--gpu-mem 40GiB --gpu A100 --micro-batch B --seq-len S ...]
                 per-rank memory of every strategy, whether it fits, and the recommended one
                 (--simulate: the recommendation also sharded on a fake process group, beside the estimate;
                 --trial [--trial-top K]: the best K plans run for a few steps here, the fastest measured wins)
  simulate --model CONFIG.yaml --strategy NAME --world-size N [--tp T --pp P --hybrid-shard-size S]
                 shard the model with the real strategy code on N fake ranks; bytes per rank role
  report RUN_DIR  redraw RUN_DIR/report.png and report.md from a run's logs (a recipe's --out, also interrupted
                 runs) or, for the daily job's --model-root, the model history from its run records
  recsys make-data OUT_DIR [--days N --rows R --every 1h]
                 write Criteo-format demo days (or hours) from a planted model with drift
  recsys daily --data-root DIR --model-root DIR [--run-date YYYY-MM-DD[_HH]] [--every 1d|1h] [--full] [--force]
                 the daily DeepFM job (same as recipes/recsys/deepfm_daily.py); --every 1h: hourly, delta versions
  recsys materialize VERSION --model-root DIR [--out DIR]
                 rebuild a delta version (its base + deltas) as one full model folder
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    commands = {"run": launch, "calibrate": _calibrate, "export": _export, "verify": _verify, "strategies": _strategies, "plan": _plan,
                "recsys": _recsys, "report": _report, "simulate": _simulate}
    if command not in commands:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"disttrain {command}: error: {e}", file=sys.stderr)
        return 1


def _user_errors() -> tuple[type[Exception], ...]:
    """The failures a command ends in one line (imported when one happens: the launcher needs neither module)."""
    from disttrain.parallel.checkpoint.io import CheckpointError
    from disttrain.parallel.guards.diskspace import DiskFullError

    return CheckpointError, FileNotFoundError, ValueError, DiskFullError


def lightning_main(argv: list[str] | None = None) -> int:
    """``lightning run model SCRIPT ...``: the command Lightning's docs show, provided by disttrain."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] != ["run", "model"]:
        print("usage: lightning run model SCRIPT [--strategy NAME --devices N --accelerator cpu|gpu ...]"
              " [script args]\n(provided by disttrain; see `disttrain --help`)", file=sys.stderr)
        return 2
    return launch(argv[2:], prog="lightning run model")


if __name__ == "__main__":
    raise SystemExit(main())
