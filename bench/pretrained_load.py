"""Loading a pretrained Hugging Face folder under each strategy: peak host memory per rank and load time of the
sharded load (``strategy.load_pretrained``: each rank reads only its own slices of the safetensors files) next to the
whole-model load (``from_pretrained`` on every rank, then the strategy shards it), in one run:

    python bench/pretrained_load.py                         # a ~1.1B-parameter Llama in bfloat16, CPU/gloo
    python bench/pretrained_load.py --layers 4 --nprocs 2   # smaller and quicker
    python bench/pretrained_load.py --smoke                 # tiny sizes: checks that it runs

The folder (config.json + model.safetensors, bfloat16) is written once under --out-dir (default bench/out/,
git-ignored). Each variant runs in fresh processes (torchrun on 127.0.0.1): fsdp, zero3 and megatron tp=2 sharded
at 2 and 4 processes, and the whole-model load under fsdp (where that many whole copies fit the machine). Per rank:
its own (anonymous) memory after imports (the baseline) and at its peak while the model is built, set up and loaded,
sampled; the kernel's peak resident set, which also counts the mapped file pages; and the model's float32 share
(its parameters' bytes over the ranks that split them). Target: own peak <= baseline + 1.1 x what it holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import each_variant, parse_smoke, run_variants, write_ranks  # noqa: E402
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
    return parse_smoke(p, hidden=64, layers=1, nprocs=[2])


def config_of(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False)


def folder_of(args) -> Path:
    return (Path(args.out_dir) if args.out_dir else OUT) / f"pretrained-llama-h{args.hidden}-l{args.layers}"


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


def held_bytes(model: torch.nn.Module) -> int:
    """The parameter bytes this process holds: its FSDP/tensor-parallel shards (DTensor local parts), its ZeRO-3
    partitions, or whole tensors."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            total += param.ds_tensor.numel() * param.ds_tensor.element_size()
        else:
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel() * local.element_size()
    return total


def fits_whole(params: int, nprocs: int) -> bool:
    """Whether ``nprocs`` whole float32 copies (plus the bfloat16 file each reads) fit in 80% of the host's memory."""
    return nprocs * params * (4 + 2) < 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rss() -> int:
    """The process's peak resident set so far (ru_maxrss), file-backed pages (the memory-mapped safetensors) included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def anonymous() -> int:
    """The process's own memory now (RssAnon: heap and tensors, not the page cache of files it maps)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """The highest RssAnon seen, sampled every 2 ms on a thread (the kernel keeps a peak of the resident set only,
    file pages included)."""

    def __init__(self) -> None:
        import threading

        self.peak = anonymous()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, anonymous())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, anonymous())


def child(args) -> None:
    for variant, result in each_variant(args.variant, args.result):
        load_variant(args, variant, result)


def load_variant(args, variant: str, result: str) -> None:
    import lightning as L
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    import disttrain

    name, options, whole = VARIANTS[variant.split("@")[0]]
    nprocs = int(os.environ["WORLD_SIZE"])
    strategy = {"disttrain_fsdp": disttrain.fabric.FSDPStrategy, "disttrain_zero3": disttrain.fabric.ZeroStrategy,
                "disttrain_megatron": disttrain.fabric.MegatronStrategy}[name](**options)
    fabric = L.Fabric(accelerator="cpu", devices=nprocs, strategy=strategy)
    fabric.launch()
    folder = folder_of(args)
    fabric.barrier()
    baseline, baseline_anon = rss(), anonymous()
    sampler = PeakSampler()
    start = time.perf_counter()
    if whole:  # every rank reads the whole folder, then the strategy shards it
        model = fabric.setup_module(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
        built = time.perf_counter()
    else:
        # no_init_weights: the load overwrites every weight, so none is initialised (under zero.Init that would
        # gather each module whole in turn)
        with fabric.init_module(empty_init=True), no_init_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
        model = fabric.setup_module(model)
        fabric.barrier()
        built = time.perf_counter()
        fabric.strategy.load_pretrained(model, folder)
    fabric.barrier()
    end = time.perf_counter()
    write_ranks(result, {"baseline": baseline, "peak": rss(), "baseline_anon": baseline_anon,
                              "peak_anon": sampler.stop(), "build_s": built - start, "load_s": end - built,
                              "held": held_bytes(model)})


def main() -> None:
    args = parse_args()
    if args.variant:
        return child(args)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    folder, params = write_folder(args)
    mib = 2**20
    header = ["variant", "processes", "1/N share MiB", "held MiB", "own peak - baseline MiB", "x held",
              "RSS peak - baseline MiB", "build + set-up s", "load s"]
    setup = (f"Llama {params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} layers) in bfloat16 safetensors,"
             f" loaded into float32; CPU/gloo")
    print(setup)
    print(f"{header[0]:<26}" + "".join(f"{h:>20}" for h in header[1:]))
    rows, skipped = [], []
    for n in args.nprocs:
        variants = [v for v in VARIANTS if not VARIANTS[v][2] or fits_whole(params, n)]
        skipped += [f"{v} at {n} processes" for v in VARIANTS if v not in variants]
        runs = run_variants(__file__, [f"{v}@{n}" for v in variants], "--variant", n, rounds=1,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, smoke_together=True)
        for variant in variants:
            ranks = runs[f"{variant}@{n}"][0]
            busiest = max(ranks, key=lambda r: (r["peak_anon"] - r["baseline_anon"]) / r["held"])
            share = 4 * params / n
            own = busiest["peak_anon"] - busiest["baseline_anon"]
            values = [n, share / mib, busiest["held"] / mib, own / mib, own / busiest["held"],
                      max(r["peak"] - r["baseline"] for r in ranks) / mib,
                      max(r["build_s"] for r in ranks), max(r["load_s"] for r in ranks)]
            print(f"{variant:<26}" + "".join(f"{v:>20}" if i == 0 else f"{v:>20.2f}" if i == 4 else f"{v:>20,.1f}"
                                             for i, v in enumerate(values)))
            rows.append([variant, *values])
    notes = ["own peak - baseline: the highest anonymous memory of the busiest process (RssAnon, sampled every 2 ms:"
             " its heap and tensors) above the same after imports and process-group set-up; 1/N share: the model's"
             " float32 bytes over the processes; held: the parameter bytes the process keeps once loaded (its shards,"
             " partitions or slices: under megatron tp=2 the embeddings, norms and head are whole on each"
             " tensor-parallel rank, sharded only over data parallelism); target: x held <= 1.1",
             "RSS peak - baseline: the kernel's peak resident set (ru_maxrss), which also counts the pages of the"
             " safetensors file the process mapped and read (its own slices, in bfloat16: about half its float32"
             " share; page cache, shared and reclaimable)",
             "build + set-up: the empty model built (under transformers' no_init_weights: the load replaces every"
             " weight) and set up by the strategy; load: strategy.load_pretrained",
             "whole: from_pretrained on every rank (the whole model once per process), then FSDP shards it"]
    if skipped:
        notes.append(f"not run (the whole model per process would not fit this machine's memory): {', '.join(skipped)}")
    for note in notes:
        print(f"- {note}")
    write_table("pretrained_load", "Loading a pretrained folder: peak host memory per rank", setup, header, rows,
                bars=("own peak - baseline MiB", "load s"),
                fmt={"1/N share MiB": ",.1f", "held MiB": ",.1f", "own peak - baseline MiB": ",.1f", "x held": ".2f",
                     "RSS peak - baseline MiB": ",.1f", "build + set-up s": ".1f", "load s": ".1f"}, notes=notes,
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
