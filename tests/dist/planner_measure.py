"""Per-rank memory measured under a registered strategy, next to the planner's estimate, on CPU processes.

Usage: planner_measure.py OUT STRATEGY [SIZE ...] [--steps N]   (SIZE: tiny, small (Llama), gpt2 (GPT-2, whose
estimate is measured on the meta device, not counted by formulas); default tiny and small, in one launch;
N timed steps after the measured ones, for bench/strategy_table.py). Each rank writes, per size, the measured
model-state bytes (after the second optimizer step, gradients still held) and the bytes the forward saved for backward, plus
the planner's estimate for the same model, strategy, world size, micro-batch, sequence and precision.
"""

import os
import statistics
import sys
import time

import lightning as L
import torch
import yaml

import disttrain  # noqa: F401  (registers the strategy names)
from disttrain.planner import detect, estimate, model_spec, step_time
from disttrain.planner.measure import SavedActivations, state_bytes

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, write_result

SIZES = {  # LlamaConfig keywords (or an HF config with its model_type), micro-batch, sequence
    "tiny": ({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}, 2, 16),
    "small": ({"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}, 2, 128),
    "gpt2": ({"model_type": "gpt2", "vocab_size": 1024, "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 256,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False, "use_cache": False},
             2, 128),
}
DEFAULT = ("tiny", "small")


def build(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if "model_type" in config:
        settings = {k: v for k, v in config.items() if k != "model_type"}
        hf = AutoConfig.for_model(config["model_type"], **settings, attn_implementation="sdpa")
        return AutoModelForCausalLM.from_config(hf)
    return LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=False, use_cache=False,
                                        attn_implementation="sdpa"))


def measure(fabric: L.Fabric, strategy: str, options: dict, size: str, timed_steps: int = 0) -> dict:
    config, batch, seq = SIZES[size]
    with fabric.init_module(empty_init="zero3" in strategy or "fsdp" in strategy):
        model = build(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(fabric.global_rank)
    acts, states = 0, {}
    for _ in range(2):  # the first step creates the optimizer state; measure the second
        ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
        with SavedActivations(model) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        acts = saved.bytes()
        fabric.backward(loss, model=model)  # DeepSpeed needs to know which engine when several exist
        optimizer.step()
        states = state_bytes(model, optimizer)
        optimizer.zero_grad()
    times = []
    for _ in range(timed_steps):
        ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
        fabric.barrier()
        t0 = time.perf_counter()
        fabric.backward(model(input_ids=ids, labels=ids).loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        fabric.barrier()
        times.append(time.perf_counter() - t0)
    e = estimate(dict(config, attn_implementation="sdpa"), strategy, world_size=fabric.world_size,
                 micro_batch=batch, seq_len=seq, precision="32-true", **options)
    return {"measured": {"states": states["total"], "params": states["params"], "grads": states["grads"],
                         "optimizer": states["optimizer"], "activations": acts,
                         "step_s": statistics.median(times) if times else None},
            "estimated_step_s": step_time(model_spec(dict(config, attn_implementation="sdpa")), e,
                                          detect(torch.device("cpu"), fabric.world_size)),
            "estimate": {"states": e.states + e.host, "params": e.params, "grads": e.grads,
                         "optimizer": e.optimizer, "host": e.host, "activations": e.activations,
                         "buffers": e.buffers}}


def main() -> None:
    spec = sys.argv[2]
    strategy = spec.split(":")[0]
    # "disttrain_megatron:tensor_parallel_size=2": the same options go to the strategy and to the estimate.
    options = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in spec.split(":")[1].split(","))} \
        if ":" in spec else {}
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy_from_spec(spec, "fabric"))
    fabric.launch()
    args = sys.argv[3:]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 0
    chosen = [a for a in args if a in SIZES] or list(DEFAULT)
    write_result({size: measure(fabric, strategy, options, size, steps) for size in chosen})


if __name__ == "__main__":
    main()
