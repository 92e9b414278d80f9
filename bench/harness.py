"""Pieces the benchmarks share: the ``--smoke`` option, the model, the timing loop, a Trainer run timed per step,
variants run in fresh processes, and the launch of a bench's ranks."""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist


def parse_smoke(p: argparse.ArgumentParser, argv: Optional[list[str]] = None, **tiny: Any) -> argparse.Namespace:
    """``p``'s arguments plus ``--smoke``: the defaults in ``tiny`` replace ``p``'s (tiny sizes, a few steps; an
    argument given on the command line still wins), so that tests/test_benches.py checks in seconds that the bench
    runs and prints its table. A smoke run's figures mean nothing. Children started with this process's arguments
    get the same sizes."""
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and a few steps: checks that the bench runs (its figures mean nothing)")
    if p.parse_known_args(argv)[0].smoke:
        p.set_defaults(**tiny)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="micro batch per rank")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG tables go (default: bench/out)")


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(4, args.hidden // 64)
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=args.seq, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def count_params(args) -> int:
    with torch.device("meta"):  # sizes only: nothing allocated
        return sum(p.numel() for p in build_model(args).parameters())


def batches(args, device) -> list[torch.Tensor]:
    """3 warm-up + ``args.steps`` timed batches, different on every rank."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, 4096, (args.batch, args.seq), generator=g).to(device) for _ in range(args.steps + 3)]


def deepspeed_rank(args) -> torch.device:
    """This rank's device (``cuda:$LOCAL_RANK`` with ``--device cuda``, else the CPU), current, with DeepSpeed's
    process group started for it (nccl / gloo): what a raw ``deepspeed.initialize`` baseline expects."""
    import deepspeed

    from disttrain.patches import skip_deepspeed_shm_op

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # started as disttrain's ZeRO engines start it: on the CPU without JIT-compiling DeepSpeed's inference-only
    # shared-memory all-reduce (training reduces through torch.distributed either way; the steps are the same)
    skip_deepspeed_shm_op()
    deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo")
    return device


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def timed_loop(step_fn, data, device) -> list[float]:
    times = []
    for i, ids in enumerate(data):
        sync(device)
        t0 = time.perf_counter()
        step_fn(ids)
        sync(device)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t0)
    return times


def trainer_step_times(args, device, data, strategy: str) -> list[float]:
    """The same model through ``lightning.Trainer`` with ``strategy``; per-step times after 3 warm-up steps."""
    import lightning as L

    import disttrain  # noqa: F401

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = build_model(args)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            sync(device)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            sync(device)
            if batch_idx >= 3:
                self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    trainer = L.Trainer(accelerator=device.type, devices=args.devices, strategy=strategy, precision=args.precision,
                        max_steps=len(data), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock], use_distributed_sampler=False)
    trainer.fit(Module(), torch.utils.data.DataLoader([d.cpu() for d in data], batch_size=None))
    return clock.times


VARIANTS_SEP = "|"


def run_variants(script: str, variants: list[str], flag: str, devices: int, rounds: int,
                 env: Optional[dict] = None, smoke_together: bool = False) -> dict[str, list[dict]]:
    """Run ``script`` once per variant and round, each time in fresh processes (torchrun on 127.0.0.1; forks of
    this process under ``--smoke``: :func:`torchrun`), so one variant's leftovers (engines, allocator caches) never
    inflate the next one's memory; rounds are interleaved so that machine noise hits the variants alike. The child
    gets ``flag VARIANT --result FILE`` after this process's own arguments, writes JSON there from rank 0; returns
    each variant's results, one per round.

    ``smoke_together``: under ``--smoke`` one launch runs all the variants in turn (a smoke run checks that each
    runs; its figures mean nothing): ``flag`` then carries them all, and the child runs the (variant, result file)
    pairs :func:`each_variant` gives it."""
    results: dict[str, list[dict]] = {v: [] for v in variants}
    together = smoke_together and "--smoke" in sys.argv[1:]
    launches = [VARIANTS_SEP.join(variants)] if together else variants
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for i, launch in enumerate(launches):
                result = os.path.join(tmp, f"{i}.json")
                torchrun([os.path.abspath(script), *sys.argv[1:], flag, launch, "--result", result], devices,
                         env=env)
                for variant, path in each_variant(launch, result):
                    with open(path) as f:
                        results[variant].append(json.load(f))
    return results


def each_variant(value: str, result: str) -> Iterator[tuple[str, str]]:
    """In a child of :func:`run_variants`: each variant its ``flag`` value names (one, or all of them with
    ``smoke_together`` under ``--smoke``), with the file its JSON goes to (``result`` itself for a single one)."""
    variants = value.split(VARIANTS_SEP)
    for i, variant in enumerate(variants):
        yield variant, result if len(variants) == 1 else f"{result}.{i}"


def fabric_steps(fabric, model, optimizer, inputs: dict, steps: int, warmup: int = 1) -> tuple[list[float], int]:
    """``warmup + steps`` optimizer steps of ``model(**inputs).loss`` under Fabric: the timed steps' seconds (every
    rank between barriers) and the bytes the last forward saved for backward (``SavedActivations``)."""
    from disttrain.planner.measure import SavedActivations

    times, saved = [], 0
    for step in range(warmup + steps):
        fabric.barrier()
        start = time.perf_counter()
        with SavedActivations(model) as activations:
            loss = model(**inputs).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sync(fabric.device)
        fabric.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        saved = activations.bytes()
    return times, saved


def write_ranks(path: str, value: object) -> None:
    """Every rank's ``value``, gathered, written as a JSON list (rank order) by rank 0: what a child of
    :func:`run_variants` leaves in its ``--result`` file."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


def free_port() -> int:
    from disttrain.ports import free_port as below_ephemeral  # a port no connection's local port can take

    return below_ephemeral("127.0.0.1")


# ---------------------------------------------------------------------------------------------------------------
# Launching the ranks

# What the ranks of a smoke run find imported when they are forked (torchrun's ranks would each import them). What
# only some benches need (deepspeed, timm, torchrec) the ranks import, unless this process has it already.
SMOKE_PRELOAD = ("lightning", "transformers", "disttrain")
GRACE_S = 30  # torchrun's grace between SIGTERM and SIGKILL for the ranks left when one fails


def torchrun(argv: list[str], nproc: int, env: Optional[dict] = None, cwd: Optional[str] = None,
             quiet: bool = False) -> None:
    """``python -m torch.distributed.run --nproc_per_node=NPROC --master_addr=127.0.0.1 ARGV`` on a free port, as
    ``subprocess.run(..., check=True)`` runs it (``quiet``: the ranks' output to /dev/null).

    Under ``--smoke`` the ranks are forked from this process instead (:func:`fork_ranks`): a smoke run checks that
    the bench runs, and most of a tiny launch is each rank importing torch, Lightning and the rest again (seconds
    of CPU per rank, and per launch for torchrun's agent). A full run always starts fresh interpreters: forked ranks
    share this process's pages, which would count in the memory figures some benches report."""
    if "--smoke" in sys.argv[1:] and fork_ranks(argv, nproc, env, cwd, quiet):
        return
    out = subprocess.DEVNULL if quiet else None
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--master_addr=127.0.0.1", f"--master_port={free_port()}", *argv],
                   check=True, env=env, cwd=cwd, stdout=out, stderr=out)


def fork_ranks(argv: list[str], nproc: int, env: Optional[dict], cwd: Optional[str], quiet: bool,
               hosts: Any = None, logs: Optional[list[str]] = None, port: Optional[int] = None) -> bool:
    """Run ``python ARGV`` on ``nproc`` ranks forked from this process, each with the environment torchrun gives
    its worker (the ranks' own store on rank 0, as ``TORCHELASTIC_USE_AGENT_STORE=False`` says); raise
    ``subprocess.CalledProcessError`` with the first failing rank's exit code, the others stopped as torchrun stops
    them. False, with nothing run, when this process has started a thread (an OpenMP pool, a tensor operation's):
    a fork would copy it half-done, so the caller launches fresh processes. tests/zygote.py forks the test suite's
    ranks the same way; unlike its ranks, these share the parent's string-hash seed.

    ``hosts``: tools/hosts.py's hosts, as many ranks on each, node by node; each rank enters its host (network,
    hostname, /etc/hosts: ``hosts.enter``) and gets the host's variables, the rendezvous on host 0 at ``port``.
    ``logs``: a file per rank for its output (appended)."""
    for name in SMOKE_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra not installed: the ranks that need it fail as they would anyway
            pass
    if "deepspeed" in sys.modules:  # each rank would probe which ops can build (compiler runs): once, here
        importlib.import_module("deepspeed.ops").__compatible_ops__  # noqa: B018
    try:
        if len(os.listdir("/proc/self/task")) != 1:
            return False
    except OSError:  # no /proc: not Linux
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    port, base = port or free_port(), dict(os.environ if env is None else env)
    nodes = hosts.count if hosts is not None else 1
    pids: list[int] = []
    codes: dict[int, int] = {}  # rank -> exit code, once reaped
    try:
        for rank in range(nproc):
            node = rank * nodes // nproc
            rank_env = {**base, **_worker_env(rank, nproc, port, nodes, hosts.main if hosts else "127.0.0.1"),
                        **(hosts.variables(node) if hosts else {})}
            pid = os.fork()
            if pid == 0:  # never returns
                _run_rank(argv, rank_env, cwd, quiet, hosts.placement(node) if hosts else None,
                          logs[rank] if logs else None)
            pids.append(pid)
        _wait_ranks(pids, codes)
    except BaseException:  # Ctrl-C, a failed fork: no rank outlives the bench
        _signal_left(pids, codes, signal.SIGKILL)
        for rank, pid in enumerate(pids):
            if rank not in codes:
                os.waitpid(pid, 0)
        raise
    failed = next((code for code in codes.values() if code != 0), 0)  # the first to fail (codes: in exit order)
    if failed:
        raise subprocess.CalledProcessError(failed, ["forked ranks:", *argv])
    return True


def _worker_env(rank: int, nproc: int, port: int, nodes: int = 1, master: str = "127.0.0.1") -> dict[str, str]:
    """torchrun's worker environment for ``rank`` of a run of ``nproc`` processes on ``nodes`` nodes (as many on
    each, node by node), its rendezvous at ``master``."""
    local = nproc // nodes
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % local), "GROUP_RANK": str(rank // local),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(local), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": master,
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _run_rank(argv: list[str], env: dict[str, str], cwd: Optional[str], quiet: bool,
              placement: Optional[dict] = None, log: Optional[str] = None) -> None:
    """In a forked rank: run ``python ARGV`` as a fresh interpreter would from here on, then exit. It never returns
    into the parent's frames (their ``finally`` blocks would remove the parent's temporary folders). ``placement``:
    the host of tools/hosts.py it enters first; ``log``: where its output goes."""
    code = 1
    try:
        # The parent's finalizers are the parent's (its TemporaryDirectory among them): not run at this rank's exit.
        # The exit handlers the libraries registered at import run, as in a fresh interpreter that imported them.
        for finalizer in list(weakref.finalize._registry):
            finalizer.atexit = False
        if placement is not None:
            from hosts import enter  # tools/hosts.py, on the path of the bench that made the hosts

            enter(**placement)
        if quiet or log:
            out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        random.seed()  # as a fresh interpreter starts: from the OS
        torch.default_generator.seed()
        if "lightning" in sys.modules:  # the one rank-dependent value Lightning reads at import (from RANK)
            from lightning.fabric.utilities.rank_zero import _get_rank
            from lightning_utilities.core.rank_zero import rank_zero_only

            rank_zero_only.rank = _get_rank() or 0
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (printed as the interpreter prints an uncaught exception)
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait_ranks(pids: list[int], codes: dict[int, int]) -> None:
    """Reap the ranks into ``codes``; when one fails, the others get SIGTERM, then SIGKILL after ``GRACE_S``."""
    kill_at = None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        failed = any(code != 0 for code in codes.values())
        if failed and kill_at is None:
            kill_at = time.monotonic() + GRACE_S
            _signal_left(pids, codes, signal.SIGTERM)
        elif kill_at is not None and time.monotonic() > kill_at:
            _signal_left(pids, codes, signal.SIGKILL)
        time.sleep(0.05)


def _signal_left(pids: list[int], done: dict[int, int], sig: signal.Signals) -> None:
    for rank, pid in enumerate(pids):
        if rank not in done:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
