"""``compile=True`` against the same run without it (Fabric, 2 processes, fp32): per strategy spec and model, the 5
step losses of both runs, the parameter names (compiled blocks keep them) and the graph counters of torch._dynamo.

Usage: compile_run.py OUT SPEC [SPEC ...]   (SPEC as common.strategy_from_spec reads it, without ``compile``)
Models: a tiny HF Llama and a tiny HF GPT-2, 2 blocks each, and the tiny ViT recipe's timm ViT
(configs/vision/vit_tiny.yaml, 4 blocks) on bench/compile_speed.py --smoke's batch, so that the bench's smoke run and
this script compile the same graphs once in the test suite's inductor cache (the blocks share one compiled graph).
A spec the strategy refuses with compile=True records the error line instead. Under disttrain_megatron, and for a
spec with a precision (``SPEC@bf16-mixed``): the Llama.
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import yaml

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, tiny_llama, write_result  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 5, 2, 16, 96
VIT_BATCH = 4  # images per rank: bench/compile_speed.py --smoke's
VIT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vision" / "vit_tiny.yaml"
MODELS = ("llama", "vit", "gpt2")


def build(name: str) -> torch.nn.Module:
    if name == "llama":
        return tiny_llama(layers=2)
    if name == "vit":
        from disttrain.vision.config import build_vit

        torch.manual_seed(0)
        return build_vit(yaml.safe_load(VIT_CONFIG.read_text())["model"])
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def loss_of(name: str, model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    if name == "vit":
        x, y = torch.randn(VIT_BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (VIT_BATCH,), generator=g)
        return F.cross_entropy(model(x), y)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model(input_ids=ids, labels=ids).loss


def run(spec: str, name: str, compile: bool) -> dict:
    # Each run as in a process of its own: torch._dynamo would otherwise see this script's earlier runs of the same
    # block code on other shapes (the unsharded, then the tensor-parallel weights) and recompile with dynamic shapes.
    torch._dynamo.reset()
    spec, _, precision = spec.partition("@")  # "SPEC@bf16-mixed": Fabric's precision (default fp32)
    spec = f"{spec}{',' if ':' in spec else ':'}compile={compile}"
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "fabric"),
                      precision=precision or "32-true")
    fabric.launch()  # under torchrun: the processes exist already
    model = build(name)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step in range(STEPS):
        loss = loss_of(name, model, step, fabric.global_rank)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    names = sorted(n for n, _ in model.named_parameters())
    return {"losses": losses, "names": names}


def main() -> None:
    from torch._dynamo.utils import counters

    results = {}
    for spec in sys.argv[2:]:
        # Megatron's tensor-parallel and pipeline graphs, and other precisions, are their own compiles: the Llama alone.
        for name in ("llama",) if spec.startswith("disttrain_megatron") or "@" in spec else MODELS:
            eager = run(spec, name, compile=False)
            counters.clear()
            try:
                compiled = run(spec, name, compile=True)
            except ValueError as e:
                results[f"{spec} {name}"] = {"refused": str(e).splitlines()[0]}
                continue
            results[f"{spec} {name}"] = {
                "eager": eager["losses"], "compiled": compiled["losses"],
                "same_names": eager["names"] == compiled["names"],
                "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    write_result(results)


main()
