"""Expert parallelism against FSDP on an MoE model: tokens/s and per-rank memory of ``disttrain_megatron
(expert_parallel_size=2)`` and ``disttrain_fsdp``, measured in one run (2 processes under torchrun, Fabric):

    python bench/moe.py                                   # CPU/gloo, configs/nlp/dialogue_moe_tiny.yaml
    python bench/moe.py --device cuda --precision bf16-mixed --seq 2048
    python bench/moe.py --smoke                           # tiny sizes: checks that it runs

The model is the dialogue recipe's tiny MoE (Qwen2-MoE: hidden 128, 4 layers, 8 experts of width 96 per layer, 2 per
token, a shared expert, the router's auxiliary loss on), ``--experts`` raises the expert count. Each rank trains its
own rows of ``--seq`` tokens under both strategies (the same data-parallel layout): FSDP shards every weight over
the 2 ranks and gathers a whole layer's experts before computing it; expert parallelism keeps half of each layer's
experts whole on each rank and sends every token to its experts' rank and back with all-to-all.

Printed per strategy: the median optimizer step (forward, backward, AdamW), the whole job's tokens per second, the
ratio to FSDP, and on the busiest rank the parameters it stores, the expert weights it computes with (FSDP: all of
them, gathered), the bytes one forward saves for backward, and the peak of the bytes it allocates (CUDA) or of its
resident set (CPU). Each strategy runs in fresh processes.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from harness import each_variant, fabric_steps, parse_smoke, run_variants, write_ranks  # noqa: E402
from tables import write_table  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "nlp" / "dialogue_moe_tiny.yaml"
STRATEGIES = {"disttrain_fsdp": {}, "disttrain_megatron ep=2": {"expert_parallel_size": 2}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rows", type=int, default=8, help="rows per rank per step")
    p.add_argument("--experts", type=int, default=32, help="experts per MoE layer")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parse_smoke(p, seq=32, rows=1, experts=4, steps=1)


def model_config(args) -> dict:
    return {**yaml.safe_load(CONFIG.read_text())["model"], "num_experts": args.experts,
            "max_position_embeddings": args.seq}


def measure(args, device: torch.device, name: str, options: dict) -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    import disttrain

    strategy = disttrain.fabric.MegatronStrategy(**options) if options else disttrain.fabric.FSDPStrategy()
    fabric = L.Fabric(accelerator=device.type, devices=2, precision=args.precision, strategy=strategy)
    fabric.launch()
    settings = dict(model_config(args))
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, use_cache=False)
    torch.manual_seed(0)
    model = fabric.setup_module(AutoModelForCausalLM.from_config(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(fabric.global_rank)
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq), generator=g).to(fabric.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, saved = fabric_steps(fabric, model, optimizer, {"input_ids": ids, "labels": ids}, args.steps, warmup=2)
    stored = computed = 0
    for pname, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        stored += local.numel() * local.element_size()
        if ".experts." in pname:
            ep = [param.device_mesh.size(i) for i, n in enumerate(param.device_mesh.mesh_dim_names) if n == "ep"]
            computed += param.numel() // (ep[0] if ep else 1) * local.element_size()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step_s = statistics.median(times)
    return {"step_s": step_s, "tokens_per_s": 2 * args.rows * args.seq / step_s, "stored": stored,
            "experts": computed, "saved": saved, "peak": peak}


def child(args) -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for variant, result in each_variant(args.variant, args.result):
        write_ranks(result, measure(args, device, variant, STRATEGIES[variant]))


def main() -> None:
    args = parse_args()
    if args.variant:
        return child(args)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # each strategy in fresh processes: one's allocations never count in the other's peak
    runs = run_variants(__file__, list(STRATEGIES), "--variant", 2, rounds=1,
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, smoke_together=True)
    ranks = [{name: runs[name][0][rank] for name in STRATEGIES} for rank in range(2)]
    mib = 2**20
    setup = (f"dialogue_moe_tiny's model with {args.experts} experts per layer (2 per token), {args.rows} rows x"
             f" {args.seq} tokens per rank, {args.device}, {args.precision}, 2 processes")
    print(setup)
    header = ["strategy", "step s", "tokens/s", "x fsdp", "stored MiB", "experts MiB", "saved MiB", "peak MiB"]
    print(f"{header[0]:<26}" + "".join(f"{h:>12}" for h in header[1:]))
    base = ranks[0]["disttrain_fsdp"]["tokens_per_s"]
    rows = []
    for name in STRATEGIES:
        first = ranks[0][name]
        busiest = {k: max(r[name][k] for r in ranks) for k in ("stored", "experts", "saved", "peak")}
        values = [first["step_s"], first["tokens_per_s"], first["tokens_per_s"] / base, busiest["stored"] / mib,
                  busiest["experts"] / mib, busiest["saved"] / mib, busiest["peak"] / mib]
        print(f"{name:<26}" + "".join(f"{v:>12.3f}" if i in (0, 2) else f"{v:>12,.1f}" for i, v in enumerate(values)))
        rows.append([name, *values])
    notes = ["stored: parameters a rank keeps between steps (its FSDP shards; under ep its experts' shards);"
             " experts: the expert weights a rank computes with (FSDP gathers all of a layer's experts, ep=2 keeps"
             " half of them whole)",
             "saved: what one forward saves for backward on the busiest rank (each storage once, parameters left out);"
             " peak: the peak of allocated bytes (CUDA) or of the process's resident set (CPU: Python, torch and"
             " transformers included), each strategy in its own processes",
             "tokens/s: the whole job's (both strategies train the same 2 x rows per step)"]
    for note in notes:
        print(f"- {note}")
    write_table("moe", "Expert parallelism vs FSDP on an MoE model", setup, header, rows,
                bars=("tokens/s", "experts MiB"),
                fmt={"step s": ".3f", "tokens/s": ",.0f", "x fsdp": ".3f", "stored MiB": ".1f", "experts MiB": ".1f",
                     "saved MiB": ".1f", "peak MiB": ".1f"}, notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
