"""Compiled blocks against eager: the step time of ``compile=True`` and of the same strategy without it, on the
dialogue demo's LLM (configs/nlp/dialogue_demo.yaml) and the tiny ViT (configs/vision/vit_tiny.yaml), measured in one
run (--devices processes under torchrun, Fabric, fp32; by default 2 on CPU, and on CUDA as many as the machine has
GPUs, at most 2: on one GPU the step of one process):

    python bench/compile_speed.py                      # CPU/gloo, disttrain_fsdp
    python bench/compile_speed.py --strategy disttrain_ddp --device cuda
    python bench/compile_speed.py --device cuda --devices 1 --steps 5
    python bench/compile_speed.py --smoke              # the tiny ViT only, a few steps

Each variant runs in fresh processes: eager; compiled with an empty compile cache (a new TORCHINDUCTOR_CACHE_DIR);
compiled again on the cache the previous run filled, as a second training run would. Printed per model: the median
step after the warm-up steps (forward, backward, AdamW), the eager/compiled ratio (above 1: compiled is faster), and
the warm-up, the first step, that includes compiling: cold, then from the cache. ``--smoke`` keeps its cache in
TORCHINDUCTOR_CACHE_DIR when that is set (the test suite's), else in .cache/torchinductor-bench, so that only its
first run on a machine compiles from nothing; its ViT batch (4 images per rank) is tests/dist/compile_run.py's, whose
compiled blocks it then finds in the suite's cache.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from harness import run_variants, sync, write_ranks  # noqa: E402
from tables import write_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"dialogue_demo": ROOT / "configs" / "nlp" / "dialogue_demo.yaml",
           "vit_tiny": ROOT / "configs" / "vision" / "vit_tiny.yaml"}
VARIANTS = ("eager", "compiled", "compiled, cached")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="disttrain_fsdp", choices=("disttrain_ddp", "disttrain_fsdp"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--devices", type=int, default=None,
                   help="processes (one GPU each on cuda); default: 2 on cpu, the machine's GPUs (at most 2) on cuda")
    p.add_argument("--seq", type=int, default=256, help="tokens per row of the LLM (its config's longest)")
    p.add_argument("--rows", type=int, default=4, help="rows (LLM) per rank per step; the ViT takes 4x as many images")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--smoke", action="store_true", help="the tiny ViT only, 4 images, 2 timed steps")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.steps = 1, 2
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.devices is None:
        args.devices = min(2, gpus) if args.device == "cuda" else 2
    if args.device == "cuda" and not gpus:
        p.error("--device cuda finds no GPU on this machine; run it on a GPU machine or pass --device cpu")
    if args.device == "cuda" and not 1 <= args.devices <= gpus:
        p.error(f"--devices {args.devices} with --device cuda needs one GPU per process; this machine has {gpus}:"
                f" pass --devices 1 to {gpus}")
    return args


def build(name: str, seq: int):
    """The recipe's model, from its config's ``model:`` section, and a function giving one step's loss."""
    import torch.nn.functional as F

    section = yaml.safe_load(CONFIGS[name].read_text())["model"]
    torch.manual_seed(0)
    if name == "vit_tiny":
        from disttrain.vision.config import build_vit

        side, classes = section["img_size"], section["num_classes"]
        def vit_loss(model, g, rows):
            images = torch.randn(4 * rows, 3, side, side, generator=g)
            logits = model(images)  # Fabric moves the images to the model's device; the labels follow the logits
            return F.cross_entropy(logits, torch.randint(0, classes, (4 * rows,), generator=g).to(logits.device))

        return build_vit(section), vit_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**section, use_cache=False, attn_implementation="sdpa"))

    def loss(model, g, rows):
        ids = torch.randint(0, section["vocab_size"], (rows, min(seq, section["max_position_embeddings"])), generator=g)
        return model(input_ids=ids, labels=ids).loss

    return model, loss


def measure(args, device: torch.device, variant: str) -> dict:
    import lightning as L

    import disttrain

    model_name, kind = variant.split(":", 1)
    cls = disttrain.fabric.DDPStrategy if args.strategy == "disttrain_ddp" else disttrain.fabric.FSDPStrategy
    fabric = L.Fabric(accelerator=device.type, devices=args.devices, strategy=cls(compile=kind != "eager"))
    fabric.launch()
    model, loss_fn = build(model_name, args.seq)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(fabric.global_rank)
    times = []
    for _ in range(2 + args.steps):
        sync(fabric.device)
        start = time.perf_counter()
        fabric.backward(loss_fn(model, g, args.rows))
        optimizer.step()
        optimizer.zero_grad()
        sync(fabric.device)
        times.append(time.perf_counter() - start)
    return {"warmup_s": times[0], "step_s": statistics.median(times[2:])}


def child(args) -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    write_ranks(args.result, measure(args, device, args.variant))


def main() -> None:
    args = parse_args()
    if args.variant:
        return child(args)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    models = ["vit_tiny"] if args.smoke else list(CONFIGS)
    with tempfile.TemporaryDirectory(prefix="torchinductor-bench-") as empty:  # the first compiled run is cold
        kept = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or ROOT / ".cache" / "torchinductor-bench"
        cache = Path(kept) if args.smoke else Path(empty)
        cache.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        # in this order: "compiled, cached" finds what "compiled" left in the cache
        runs = run_variants(__file__, [f"{m}:{v}" for m in models for v in VARIANTS], "--variant", args.devices,
                            rounds=1, env=env)
    slowest = {key: {k: max(r[k] for r in res[0]) for k in ("warmup_s", "step_s")} for key, res in runs.items()}
    processes = f"{args.devices} process{'es' if args.devices > 1 else ''}"
    setup = (f"{args.strategy}, {args.device}, fp32, {processes}; LLM: {args.rows} rows x {args.seq} tokens per rank;"
             f" ViT: {4 * args.rows} images per rank; median of {args.steps} steps after 2 warm-up steps")
    print(setup)
    header = ["model", "eager step s", "compiled step s", "x faster", "compile warm-up s", "cached warm-up s"]
    print(f"{header[0]:<16}" + "".join(f"{h:>19}" for h in header[1:]))
    rows = []
    for m in models:
        eager, cold, warm = (slowest[f"{m}:{v}"] for v in VARIANTS)
        values = [eager["step_s"], warm["step_s"], eager["step_s"] / warm["step_s"], cold["warmup_s"],
                  warm["warmup_s"]]
        print(f"{m:<16}" + "".join(f"{v:>19.3f}" for v in values))
        rows.append([m, *values])
    notes = ["compiled step s: the run on the filled cache (the same code as the cold run's); x faster: eager step /"
             " compiled step",
             "compile warm-up s: the first step of a compiled run with an empty cache (tracing, inductor and the C++"
             " compiler); cached warm-up s: the same on the cache that run filled, as a second training run starts"
             + (" (--smoke keeps one cache across its runs: both may be cached)" if args.smoke else ""),
             "TORCHINDUCTOR_CACHE_DIR: " + (str(cache) if args.smoke else "a new folder")
             + "; eager warm-up s for comparison: "
             + ", ".join(f"{m} {slowest[f'{m}:eager']['warmup_s']:.3f}" for m in models)]
    for note in notes:
        print(f"- {note}")
    write_table("compile_speed", "Compiled blocks vs eager", setup, header, rows, bars=("x faster",),
                fmt={h: ".3f" for h in header[1:]}, notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
