"""Loading a pretrained Hugging Face folder under each strategy: peak host memory per rank and load time of the
sharded load (``strategy.load_pretrained``: each rank reads only its own slices of the safetensors files) next to the
whole-model load (``from_pretrained`` on every rank, then the strategy shards it), in one run:

    python bench/pretrained_load.py                         # a ~1.1B-parameter Llama in bfloat16, CPU/gloo
    python bench/pretrained_load.py --layers 4 --nprocs 2   # smaller and quicker

The folder (config.json + model.safetensors, bfloat16) is written once under bench/out/ (git-ignored). Each variant
runs in fresh processes (torchrun on 127.0.0.1): fsdp, zero3 and megatron tp=2 sharded at 2 and 4 processes, and
the whole-model load under fsdp. Per rank: the resident set after imports (the baseline), its peak while the model is
built, set up and loaded, and the model's float32 share (its parameters' bytes over the ranks that split them).
Target: peak <= baseline + 1.1 x share.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import run_variants, write_ranks  # noqa: E402
from tables import write_table  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
VARIANTS = {"disttrain_fsdp, whole": ("disttrain_fsdp", {}, True), "disttrain_fsdp": ("disttrain_fsdp", {}, False),
            "disttrain_zero3": ("disttrain_zero3", {}, False),
            "disttrain_megatron tp=2": ("disttrain_megatron", {"tensor_parallel_size": 2}, False)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def config_of(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False)


def folder_of(args) -> Path:
    return OUT / f"pretrained-llama-h{args.hidden}-l{args.layers}"


def write_folder(args) -> tuple[Path, int]:
    """The bfloat16 folder (written once), and its parameter count."""
    from transformers import AutoModelForCausalLM

    folder = folder_of(args)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config_of(args)).parameters())
    if not (folder / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_of(args), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
    return folder, params


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(args) -> None:
    import lightning as L
    from transformers import AutoConfig, AutoModelForCausalLM

    import disttrain

    name, options, whole = VARIANTS[args.variant.split("@")[0]]
    nprocs = int(os.environ["WORLD_SIZE"])
    strategy = {"disttrain_fsdp": disttrain.fabric.FSDPStrategy, "disttrain_zero3": disttrain.fabric.ZeroStrategy,
                "disttrain_megatron": disttrain.fabric.MegatronStrategy}[name](**options)
    fabric = L.Fabric(accelerator="cpu", devices=nprocs, strategy=strategy)
    fabric.launch()
    folder = folder_of(args)
    fabric.barrier()
    baseline = rss()
    start = time.perf_counter()
    if whole:  # every rank reads the whole folder, then the strategy shards it
        model = fabric.setup_module(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    else:
        with fabric.init_module(empty_init=True):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
        model = fabric.setup_module(model)
        fabric.strategy.load_pretrained(model, folder)
    fabric.barrier()
    seconds = time.perf_counter() - start
    write_ranks(args.result, {"baseline": baseline, "peak": rss(), "seconds": seconds})


def main() -> None:
    args = parse_args()
    if args.variant:
        return child(args)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    folder, params = write_folder(args)
    mib = 2**20
    header = ["variant", "processes", "baseline MiB", "peak MiB", "peak - baseline MiB", "share MiB", "x share",
              "load s"]
    setup = (f"Llama {params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} layers) in bfloat16 safetensors,"
             f" loaded into float32; CPU/gloo")
    print(setup)
    print(f"{header[0]:<26}" + "".join(f"{h:>20}" for h in header[1:]))
    rows = []
    for n in args.nprocs:
        runs = run_variants(__file__, [f"{v}@{n}" for v in VARIANTS], "--variant", n, rounds=1,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
        for variant in VARIANTS:
            ranks = runs[f"{variant}@{n}"][0]
            busiest = max(ranks, key=lambda r: r["peak"] - r["baseline"])
            # megatron tp=2 x FSDP over the rest: every parameter split over all ranks (tp x dp)
            share = 4 * params / n
            grown = busiest["peak"] - busiest["baseline"]
            values = [n, busiest["baseline"] / mib, busiest["peak"] / mib, grown / mib, share / mib, grown / share,
                      max(r["seconds"] for r in ranks)]
            print(f"{variant:<26}" + "".join(f"{v:>20,.1f}" if i not in (0, 5) else f"{v:>20}" if i == 0
                                             else f"{v:>20.2f}" for i, v in enumerate(values)))
            rows.append([variant, *values])
    notes = ["peak: the process's peak resident set (ru_maxrss), Python, torch and the libraries included; baseline:"
             " the same after imports and process-group set-up, before the model; share: the model's float32 bytes"
             " over the processes (every strategy here splits every parameter over all of them)",
             "whole: from_pretrained on every rank (the whole model once per process), then FSDP shards it"]
    for note in notes:
        print(f"- {note}")
    write_table("pretrained_load", "Loading a pretrained folder: peak host memory per rank", setup, header, rows,
                bars=("peak - baseline MiB", "load s"),
                fmt={"baseline MiB": ",.1f", "peak MiB": ",.1f", "peak - baseline MiB": ",.1f", "share MiB": ",.1f",
                     "x share": ".2f", "load s": ".1f"}, notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
