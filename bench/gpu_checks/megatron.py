"""Check 7: ``disttrain_megatron`` and the pipeline code on CUDA tensors.

- World size 1: ``MegatronStrategy(tensor_parallel_size=1, pipeline_parallel_size=1)`` under Fabric against a plain
  one-device loop from the same weights on the same data (fp32, TF32 off), and ``pipeline_model`` on a one-rank
  pipeline mesh (GPipe and 1F1B schedules, stage module, loss, broadcast) against one forward/backward.
- Two processes on one GPU over gloo (NCCL refuses two ranks on one device): the Llama tensor-parallel plan at
  tp=2 against the unsharded model, in ``gpu_checks/tp_worker.py``. gloo moves CUDA tensors for all-reduce and
  broadcast only, so this runs where the driver and torch allow it and is skipped with the error otherwise.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from disttrain.ports import free_port
from gpu_checks.common import ROOT, TINY_LLAMA, Context, Row, build_llama, child_env, fabric, free_memory, \
    guarded, learnable_batches, max_relative_diff, skipped

CHECK = "7 megatron / pipeline"
TOLERANCE = 1e-4  # fp32 with TF32 off: only reduction order differs
MODEL = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
STEPS = 4


def _fp32_exact() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def reference_losses(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def model(ctx: Context) -> dict:
    return TINY_LLAMA if ctx.dry else MODEL


def megatron_world_size_1(ctx: Context, batches: list[torch.Tensor]) -> Row:
    import disttrain
    from gpu_checks.training import train_step

    reference = reference_losses(build_llama(model(ctx), ctx.device), batches)
    f = fabric(ctx, disttrain.fabric.MegatronStrategy(tensor_parallel_size=1, pipeline_parallel_size=1), "32-true")
    lm = build_llama(model(ctx), ctx.device)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    lm, optimizer = f.setup(lm, optimizer)
    losses = [train_step(f, lm, optimizer, [ids]).item() for ids in batches]
    on_device = {p.to_local().device.type if hasattr(p, "to_local") else p.device.type for p in lm.parameters()}
    diff = max_relative_diff(losses, reference)
    ok = diff <= TOLERANCE and on_device == {ctx.device.type}
    del lm, optimizer, f
    free_memory()
    return Row(CHECK, f"disttrain_megatron tp=1 pp=1, world size 1, {len(batches)} steps, fp32",
               f"max loss diff {diff:.1e} vs a plain loop; parameters on {sorted(on_device)}",
               f"losses within {TOLERANCE:.0e} of one device without the strategy", ok,
               "" if ok else f"loss diff {diff:.1e} or parameters not on {ctx.device.type}", value=diff,
               details={"losses": losses, "reference": reference})


def pipeline_world_size_1(ctx: Context, ids: torch.Tensor) -> list[Row]:
    from torch.distributed.device_mesh import init_device_mesh

    reference = build_llama(model(ctx), ctx.device)
    loss = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("pp",))
    rows = []
    # Interleaved 1F1B is left out: on one rank its two stages would send to themselves, which torch 2.11's schedule
    # does over the process group (gloo refuses it); at pipeline_parallel_size >= 2 stages never talk to their own
    # rank, and disttrain_megatron builds no pipeline below that.
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1)):
        item = f"pipeline {schedule}, 1 stage on 1 rank, 2 microbatches"
        rows += guarded(CHECK, item, "loss and gradients of one forward/backward",
                        lambda: one_schedule(ctx, reference, loss.item(), ids, mesh, schedule, virtual, item))
    return rows


def one_schedule(ctx: Context, reference: torch.nn.Module, loss: float, ids: torch.Tensor, mesh: object,
                 schedule: str, virtual: int, item: str) -> Row:
    from disttrain.parallel.split.pipeline import pipeline_model

    grads = {n: p.grad for n, p in reference.named_parameters()}
    lm = copy.deepcopy(reference)
    lm.zero_grad(set_to_none=True)
    pipeline_model(lm, mesh, ctx.device, schedule=schedule, microbatches=2, virtual_stages=virtual)
    out = lm(input_ids=ids, labels=ids)
    loss_diff = abs(out.loss.item() - loss) / loss
    grad_diff = max(float((p.grad - grads[n]).abs().max() / grads[n].abs().max().clamp(min=1e-12))
                    for n, p in lm.named_parameters() if p.grad is not None)
    ok = loss_diff <= TOLERANCE and grad_diff <= 1e-3 and out.loss.device.type == ctx.device.type
    return Row(CHECK, item, f"loss diff {loss_diff:.1e}, max gradient diff {grad_diff:.1e} (relative to the largest)",
               "loss and gradients of one forward/backward", ok,
               "" if ok else "the pipeline's loss or gradients differ", value=grad_diff)


def tensor_parallel_two_processes(ctx: Context) -> Row:
    target = f"tp=2 losses within {TOLERANCE:.0e} of the unsharded model"
    item = "tensor parallel tp=2, 2 processes on one device, gloo"
    with tempfile.TemporaryDirectory(dir=ctx.work) as tmp:
        result = Path(tmp) / "result"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port('127.0.0.1')}", str(ROOT / "bench" / "gpu_checks" / "tp_worker.py"),
               str(result),
               ctx.device.type, json.dumps(model(ctx)), str(STEPS), str(16 if ctx.dry else 64)]
        env = child_env(OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result.*.json"))]
    if len(ranks) != 2 or any("error" in r for r in ranks):
        error = next((r["error"] for r in ranks if "error" in r), None) or (proc.stderr.strip().splitlines() or
                                                                          ["no output"])[-1]
        return skipped(CHECK, item, target, f"did not run on this machine: {error}"[:500])
    diff = max(max_relative_diff(r["losses"], r["reference"]) for r in ranks)
    ok = diff <= TOLERANCE and all(r["sharded"] for r in ranks)
    return Row(CHECK, item, f"max loss diff {diff:.1e} over {STEPS} steps; q_proj rows per rank "
                            f"{ranks[0]['local_rows']} of {ranks[0]['full_rows']}", target, ok,
               "" if ok else f"loss diff {diff:.1e}", value=diff, details={"ranks": ranks})


def run(ctx: Context) -> Iterator[Row]:
    _fp32_exact()
    batches = learnable_batches(model(ctx)["vocab_size"], 4, 16 if ctx.dry else 64, STEPS, ctx.device)
    yield from guarded(CHECK, "disttrain_megatron tp=1 pp=1, world size 1", "matches a plain loop",
                       lambda: megatron_world_size_1(ctx, batches))
    yield from guarded(CHECK, "pipeline schedules on one rank", "match one forward/backward",
                       lambda: pipeline_world_size_1(ctx, batches[0]))
    yield from guarded(CHECK, "tensor parallel tp=2, 2 processes", "matches the unsharded model",
                       lambda: tensor_parallel_two_processes(ctx))
