"""Run by ``disttrain plan --trial`` in every process (``disttrain run``'s launcher): a few training steps of one
plan on the devices present, timed; rank 0 writes the step times.

Usage: trial_run.py OUT PLAN_JSON   (PLAN_JSON: {"model": recipe path or model mapping, "strategy", "options",
"micro_batch", "seq_len", "precision", "model_recomputes", "steps"})

The model is built from its config with random weights and trained on random data of the plan's shapes: a step's
time depends on the shapes, not on the values. Each rank gets ``micro_batch x tp x pp x cp`` samples, the batch the
planner counts per data-parallel rank (the same global batch under every strategy).
"""

import json
import os
import statistics
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import STRATEGY_REGISTRY

import disttrain  # noqa: F401  (registers the disttrain_* names)
from disttrain.parallel import registry
from disttrain.planner.spec import model_spec, recipe_model

# TEST ONLY: "strategy label=seconds[;label=seconds]" adds that many seconds to every step of the plan with that
# label, so a test can make one plan the slow one whatever the machine's noise.
DELAY = "DISTTRAIN_TRIAL_DELAY"


def build(mapping: dict):
    """The model of a ``model:`` mapping, with random weights: an HF causal LM (Llama keys or ``model_type``) or a
    timm VisionTransformer."""
    from disttrain.parallel.families import family_for_config

    family = family_for_config(mapping)
    name = family.name if family is not None else None
    if name == "vit":
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(**mapping), "vit"
    if name == "deepfm":
        raise ValueError("trials of embedding-table models (disttrain_recsys) are not supported")
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in mapping.items() if k != "model_type"}
    config = AutoConfig.for_model(mapping.get("model_type", "llama"), **settings)
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), "lm"


def delay(label: str) -> float:
    for item in filter(None, os.environ.get(DELAY, "").split(";")):
        name, seconds = item.rsplit("=", 1)
        if name.strip() == label:
            return float(seconds)
    return 0.0


def main() -> None:
    out, job = sys.argv[1], json.loads(sys.argv[2])
    source = job["model"]
    mapping = recipe_model(source) if isinstance(source, str) else dict(source)
    spec = model_spec(source)
    row = registry.lookup(job["strategy"])
    options = job["options"]
    dims = row.dims(int(os.environ["WORLD_SIZE"]), row.options(**options))
    entry = STRATEGY_REGISTRY[job["strategy"]]
    fabric = L.Fabric(strategy=entry["strategy"](**{**entry["init_params"], **options}),
                      precision=job["precision"])
    if not os.environ.get("LT_CLI_USED"):
        fabric.launch()
    with fabric.init_module():
        model, kind = build(mapping)
    if job["model_recomputes"]:
        if kind == "vit":
            model.set_grad_checkpointing(True)
        else:
            model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = fabric.setup(model, optimizer)
    pipelined = kind == "vit" and getattr(fabric.strategy.engine, "pipeline", None) is not None
    if pipelined:
        model.pipeline.loss_fn = F.cross_entropy  # a ViT computes no loss itself: the pipeline's last stage does
    batch = job["micro_batch"] * dims.tp * dims.pp * dims.cp
    seq = int(job["seq_len"] or spec.tokens or 1)
    g = torch.Generator().manual_seed(0)  # every rank the same data: tensor-parallel ranks need the same batch
    extra = delay(job["label"])

    def step() -> None:
        if kind == "vit":
            images = torch.randn(batch, spec.in_chans or 3, spec.image_size, spec.image_size, generator=g)
            labels = torch.randint(0, max(1, spec.num_classes), (batch,), generator=g)
            images, labels = fabric.to_device(images), fabric.to_device(labels)
            loss = model(images, target=labels) if pipelined else F.cross_entropy(model(images), labels)
        else:
            ids = fabric.to_device(torch.randint(0, spec.vocab, (batch, seq), generator=g))
            loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        if extra:
            time.sleep(extra)

    times = []
    for i in range(1 + job["steps"]):  # one warm-up step (allocations, first gathers, JIT)
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()
        fabric.barrier()
        t0 = time.perf_counter()
        step()
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()
        fabric.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    if fabric.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "median": statistics.median(times)}, f)


if __name__ == "__main__":
    main()
