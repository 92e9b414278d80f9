"""Context parallelism through ``disttrain_megatron(context_parallel_size=2)``: activation memory per rank and step
time against the same strategy at cp=1, measured in one run (2 processes under torchrun, Fabric):

    python bench/context_parallel.py                              # CPU/gloo, seq 8192, configs/nlp/dialogue_tiny.yaml
    python bench/context_parallel.py --device cuda --precision bf16-mixed --seq 32768
    python bench/context_parallel.py --smoke                      # tiny sizes: checks that it runs

The model is the dialogue recipe's tiny one (vocab 2048, hidden 128, 4 layers, 4 heads, 2 key/value heads) with
``max_position_embeddings`` raised to ``--seq``. cp=1: each of the 2 ranks trains its own row of ``--seq`` tokens (FSDP
over 2 data-parallel ranks); cp=2: both ranks train one row together, each computing half of its tokens (FSDP over
the same 2 ranks, now context-parallel). Two layouts: one sequence per row, and a row packed with 512-token
dialogues (HF builds a (1, 1, T, T) mask for them under SDPA, which every rank needs whole: see the notes).

Printed per rank: the bytes one forward saves for backward (``disttrain.planner.measure.SavedActivations``: each
storage once, parameters left out: what activation memory is made of), the planner's estimate of it, the median
optimizer step (forward, backward, AdamW) and the tokens per second of the whole job. Target: cp=2 saves at most 0.55x
of cp=1's activations per rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from harness import fabric_steps, parse_smoke, torchrun  # noqa: E402
from tables import write_table  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "nlp" / "dialogue_tiny.yaml"
LAYOUTS = {"one sequence": 0, "packed, 512-token dialogues": 512}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    p.add_argument("--steps", type=int, default=3, help="timed steps (after 1 warm-up step)")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, seq=256, steps=1)


def model_config(args) -> dict:
    return {**yaml.safe_load(CONFIG.read_text())["model"], "max_position_embeddings": args.seq}


def row(args, dialogue: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model_config(args)["vocab_size"], (1, args.seq), generator=g)
    positions = torch.arange(args.seq) % dialogue if dialogue else torch.arange(args.seq)
    return {k: v.to(device) for k, v in {"input_ids": ids, "labels": ids, "position_ids": positions[None]}.items()}


def measure(args, device: torch.device, cp: int, dialogue: int) -> dict:
    """One configuration on this rank: saved activations of a forward, median step, the planner's estimate."""
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    import disttrain
    from disttrain.planner import estimate

    fabric = L.Fabric(accelerator=device.type, devices=2, precision=args.precision,
                      strategy=disttrain.fabric.MegatronStrategy(context_parallel_size=cp))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(LlamaConfig(**model_config(args), attn_implementation="sdpa", use_cache=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    dp_rank = fabric.strategy.distributed_sampler_kwargs["rank"]  # cp=2: both ranks read the same row
    inputs = row(args, dialogue, seed=dp_rank, device=fabric.device)
    times, saved = fabric_steps(fabric, model, optimizer, inputs, args.steps)
    planned = estimate(dict(model_config(args), attn_implementation="sdpa"), "disttrain_megatron", 2, seq_len=args.seq,
                       precision=args.precision, **({"context_parallel_size": cp} if cp > 1 else {}))
    step_s = statistics.median(times)
    rows_per_step = fabric.strategy.engine.dims.dp  # cp=1: two rows (one per rank); cp=2: one row
    return {"saved": saved, "planned": planned.activations, "step_s": step_s,
            "tokens_per_s": rows_per_step * args.seq / step_s}


def child(args) -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {name: {str(cp): measure(args, device, cp, dialogue) for cp in (1, 2)}
               for name, dialogue in LAYOUTS.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(everyone, f)


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        torchrun([os.path.abspath(__file__), *sys.argv[1:], "--child", "--result", result], 2,
                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = json.loads(Path(result).read_text())
    mib = 2**20
    setup = (f"dialogue_tiny's model (hidden 128, 4 layers, 4 heads / 2 kv heads), seq {args.seq}, {args.device},"
             f" {args.precision}, 2 processes; disttrain_megatron context_parallel_size=2 vs 1")
    print(setup)
    print(f"{'layout':<30} {'cp':>3} {'saved MiB/rank':>15} {'x cp=1':>7} {'planner MiB':>12} {'step s':>8}"
          f" {'tokens/s':>9}")
    rows = []
    for name in LAYOUTS:
        base = max(r[name]["1"]["saved"] for r in ranks)
        for cp in ("1", "2"):
            saved = max(r[name][cp]["saved"] for r in ranks)  # the busiest rank
            first = ranks[0][name][cp]
            ratio = saved / base
            print(f"{name:<30} {cp:>3} {saved / mib:>15.1f} {ratio:>7.3f} {first['planned'] / mib:>12.1f}"
                  f" {first['step_s']:>8.3f} {first['tokens_per_s']:>9,.0f}")
            rows.append([name, int(cp), saved / mib, ratio, first["planned"] / mib, first["step_s"],
                         first["tokens_per_s"]])
    notes = ["saved: what one forward saves for backward on the busiest rank (each storage once, parameters left"
             " out); planner: disttrain.planner.estimate's activations for the same set-up",
             "packed rows: under SDPA HF materialises a (1, 1, T, T) mask for the dialogues, which every cp rank"
             " needs whole (it attends over the whole sequence); disttrain's all-to-all makes one shared additive copy"
             " for all layers (SDPA would keep one per layer), and the planner does not count it. flash_attention_2"
             " reads packed rows from position_ids and builds no mask",
             "tokens/s: the whole job's (cp=1 trains two rows per step, cp=2 one)"]
    for note in notes:
        print(f"- {note}")
    write_table("context_parallel", "Context parallelism: activations per rank and step time", setup,
                ["layout", "cp", "saved MiB/rank", "x cp=1", "planner MiB", "step s", "tokens/s"], rows,
                bars=("saved MiB/rank", "step s"), fmt={"saved MiB/rank": ".1f", "x cp=1": ".3f",
                                                        "planner MiB": ".1f", "step s": ".3f", "tokens/s": ",.0f"},
                notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
