"""Every causal-LM family of the installed transformers whose config declares a tensor-parallel plan, trained with
``disttrain_megatron(tensor_parallel_size=2)`` (Fabric) against one process in this script.

Usage: hf_tp_plans.py OUT [MODEL_TYPE ...]    (default: every such model type)

Each model type gets a tiny config (:func:`tiny_config`: the widths below written over the class's defaults). One
that cannot be built tiny, or whose forward does not run on one CPU process in float32, is recorded as "skipped"
with the reason (it is not a disttrain matter); otherwise 2 SGD steps on the same batches in both runs, and the
losses are recorded, or the one-line refusal of the strategy.
"""

import os
import sys

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import tmpdir, write_result  # noqa: E402,F401

VOCAB, SEQ, BATCH, STEPS, MAX_PARAMS = 128, 16, 2, 2, 6_000_000
# Written over every config class's defaults (keys a class does not take are left out).
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=False, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, residual_dropout=0.0, router_jitter_noise=0.0,
            input_jitter_noise=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # no randomness in training


def model_types() -> list[str]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING
                  and getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None))


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    config = cls(**{k: v for k, v in TINY.items() if k in defaults})
    config._attn_implementation = "eager"
    return config


# Mamba hybrids whose selective scan runs seconds per step on CPU without its kernels: counted, not trained here.
SLOW = ("bamba", "falcon_h1", "granitemoehybrid")


def build(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_type in SLOW:
        raise RuntimeError("a Mamba hybrid: its scan runs seconds per step on CPU without its kernels")
    config = tiny_config(model_type)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:  # the class names its widths otherwise: not made tiny by TINY
        raise ValueError(f"{params / 1e6:.0f}M parameters with the tiny widths (its config names them otherwise)")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def batch(step: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train(fabric, model, optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def reference(model_type: str) -> dict:
    """One process's losses, or why the model does not run tiny on one CPU process (then it is only counted)."""
    try:
        model = build(model_type)
        return {"ref_losses": train(None, model, torch.optim.SGD(model.parameters(), lr=0.1), STEPS)}
    except Exception as e:  # noqa: BLE001  the model itself does not run tiny on one CPU process
        return {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def check(fabric: L.Fabric, model_type: str) -> dict:
    # rank 0 runs the reference and tells the other rank (the two would compute the same, on shared cores)
    ref = [reference(model_type) if fabric.global_rank == 0 else None]
    torch.distributed.broadcast_object_list(ref, src=0)
    if "skipped" in ref[0]:
        return ref[0]
    ref_losses = ref[0]["ref_losses"]
    model = build(model_type)
    try:
        model = fabric.setup_module(model)
    except ValueError as e:
        return {"refused": str(e)}
    try:
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        return {"losses": train(fabric, model, optimizer, STEPS), "ref_losses": ref_losses}
    except Exception as e:  # noqa: BLE001  recorded for the test to show; both ranks fail alike under TP
        return {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


names = sys.argv[2:] or model_types()
fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                  strategy=disttrain.fabric.MegatronStrategy(tensor_parallel_size=2))
fabric.launch()
write_result({name: check(fabric, name) for name in names})
