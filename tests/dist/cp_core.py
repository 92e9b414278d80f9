"""Context parallelism (disttrain.parallel.split.cp) against one process, on CPU with gloo.

Usage: cp_core.py OUT CASE [CASE ...] under torchrun. Every rank writes OUT.<rank>.json, {case: result}: its losses
(the cp ranks of one batch must all hold the one-process loss). After all parallel runs, rank ``i % world`` trains
an unsplit model of case i from the same seed on the same data (the reference) and records the relative errors:
losses of 5 AdamW steps, parameter gradients of step 1 (after the gradient reduction over the cp ranks: FSDP's, or
an average), logits and loss of an evaluation forward. The cases are listed in CASES; "refusals" and "layout"
check the errors and the token orders instead.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from disttrain.parallel.families.llama import llama_plan
from disttrain.parallel.split.cp import ContextParallel, apply_context_parallel, shift_labels

VOCAB, STEPS, LR, BATCH = 128, 5, 1e-2, 2


def tiny(family: str, attn: str, **overrides: Any):
    """A 2-layer, hidden-64 decoder of ``family`` with random weights (seed 0): 4 query heads, 2 key/value heads.
    Initialised 10x wider than HF's default, so that attention is far from uniform: which tokens a query may see
    (packed dialogues, sliding windows) then changes the loss visibly."""
    import transformers

    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                                 "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False,
                  attn_implementation=attn, initializer_range=0.2)
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    return getattr(transformers, model_class)(config)


def packed_batch(seed: int, length: int) -> dict[str, torch.Tensor]:
    """(BATCH, length) rows packed as chat SFT packs dialogues: position_ids restart at 0 at every dialogue (20-400
    tokens), the first label of each dialogue and its prompt span (the user's turn) are -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=g)
    positions = torch.empty(BATCH, length, dtype=torch.long)
    labels = ids.clone()
    for row in range(BATCH):
        start = 0
        while start < length:
            size = min(int(torch.randint(20, 400, (1,), generator=g)), length - start)
            positions[row, start:start + size] = torch.arange(size)
            prompt = int(torch.randint(1, max(2, size // 2), (1,), generator=g))
            labels[row, start:start + prompt] = -100
            start += size
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


# case -> (model factory, sequence length, layout, activation checkpointing)
#   layout: "cp" (all ranks one cp group, gradients averaged by hand), "fsdp" (FSDP2 over the 1-D cp mesh),
#   "dp_cp" (2-D mesh (dp, cp), FSDP over the flattened dp x cp; each dp rank its own batch),
#   "cp_tp" (2-D mesh (cp, tp): tensor parallel over tp, FSDP over cp)
CASES: dict[str, tuple[Callable[[], Any], int, str, bool]] = {
    "llama_eager": (lambda: tiny("llama", "eager"), 1024, "cp", False),
    "llama_sdpa": (lambda: tiny("llama", "sdpa"), 1024, "cp", False),
    "llama_sdpa_2048": (lambda: tiny("llama", "sdpa"), 2048, "cp", False),
    "qwen2_sdpa": (lambda: tiny("qwen2", "sdpa"), 1024, "cp", False),
    "qwen2_eager_sliding": (lambda: tiny("qwen2", "eager", use_sliding_window=True, sliding_window=32,
                                         max_window_layers=1), 1024, "cp", False),
    "mistral_sliding": (lambda: tiny("mistral", "sdpa", sliding_window=64), 1024, "cp", False),
    "fsdp_ac": (lambda: tiny("llama", "sdpa"), 1024, "fsdp", True),
    "dp_cp": (lambda: tiny("llama", "sdpa"), 1024, "dp_cp", True),
    "cp_tp": (lambda: tiny("llama", "eager"), 1024, "cp_tp", False),
}


def build_mesh(layout: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh | None, int, int]:
    """(cp mesh, mesh FSDP shards over or the cp mesh, tp mesh or None, dp rank, dp size)."""
    world = dist.get_world_size()
    if layout == "dp_cp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
        return mesh["cp"], mesh["dp", "cp"]._flatten("dp_cp"), None, mesh["dp"].get_local_rank(), 2
    if layout == "cp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("cp", "tp"))
        return mesh["cp"], mesh["cp"], mesh["tp"], 0, 1
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return mesh["cp"], mesh["cp"], None, 0, 1


def parallelize(model, layout: str, ac: bool) -> tuple[ContextParallel, int, int]:
    """CP first, then TP, activation checkpointing and FSDP (the order an engine applies them in)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cp_mesh, fsdp_mesh, tp_mesh, dp_rank, dp = build_mesh(layout)
    ctx = apply_context_parallel(model, cp_mesh)
    layers = model.model.layers
    if tp_mesh is not None:
        for layer in layers:
            parallelize_module(layer, tp_mesh, llama_plan())
    if ac:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    if layout != "cp":
        for layer in layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return ctx, dp_rank, dp


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (DTensor shards gathered: a collective on every rank)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return grads


def relative_error(values: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


def grad_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """``max``: the largest over parameters of max|g - g_ref| / max|g_ref|; ``global``: ||g - g_ref|| / ||g_ref|| over
    all parameters; ``worst``: the parameter of ``max``."""
    assert grads.keys() == reference.keys(), (sorted(grads), sorted(reference))
    per = {n: ((grads[n] - r).abs().max() / r.abs().max()).item() for n, r in reference.items()}
    worst = max(per, key=per.get)
    diff = torch.cat([(grads[n] - r).flatten() for n, r in reference.items()])
    norm = torch.cat([r.flatten() for r in reference.values()])
    return {"max": per[worst], "worst": worst, "global": (diff.norm() / norm.norm()).item()}


def run_case(name: str) -> dict[str, Any]:
    """The case's parallel run, on every rank: its losses, its step-1 gradients after the reduction over the cp
    ranks, and an evaluation forward of the untrained model (its local logits gathered on every rank)."""
    factory, length, layout, ac = CASES[name]
    model = factory()
    ctx, dp_rank, dp = parallelize(model, layout, ac)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    with torch.no_grad():
        evaluated = model(**packed_batch(999, length))
        local_shape = list(evaluated.logits.shape)  # this rank's tokens, in evaluation too
        evaluated.logits = ctx.gather(evaluated.logits)
    # FSDP2 keeps the root's parameters gathered after its forward (backward needs them next); with no backward
    # coming, reshard them, or the next optimizer step would update the shards while forward used stale gathers.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    losses, grads = [], {}
    for step in range(STEPS):
        out = model(**packed_batch(100 * step + dp_rank, length))
        loss = out.loss
        loss.backward()
        if layout == "cp":  # no FSDP: average over the cp ranks by hand
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=ctx.group)
        if step == 0:
            grads = full_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # What the one-process reference computes: the mean loss over the dp batches (every rank holds its batch's).
    means = torch.tensor(losses)
    dist.all_reduce(means, op=dist.ReduceOp.AVG)
    return {"losses": losses, "mean_losses": means.tolist(), "cp": ctx.cp, "dp": dp, "dp_rank": dp_rank,
            "grads": grads, "eval": evaluated, "train_logits_shape": list(out.logits.shape),
            "eval_logits_shape": local_shape,
            "attached": model.context_parallel is ctx}


def compare(name: str, run: dict[str, Any]) -> dict[str, Any]:
    """The one-process reference of a case (an unsplit model from the same seed, the mean loss over the dp
    batches), and the relative errors of the parallel run against it."""
    factory, length, _, _ = CASES[name]
    model = factory()
    probe = packed_batch(999, length)
    with torch.no_grad():
        expected = model(**probe)
    ref_losses, ref_grads = train_reference(model, length, run["dp"])
    evaluated = run["eval"]
    result = {"ref_losses": ref_losses, "loss_error": relative_error(run["mean_losses"], ref_losses),
              "grad_error": grad_errors(run["grads"], ref_grads), "logits_shape": list(evaluated.logits.shape),
              "eval_loss": expected.loss.item(),
              "eval_loss_error": abs(evaluated.loss.item() - expected.loss.item()) / expected.loss.item(),
              "eval_logits_error": ((evaluated.logits - expected.logits).abs().max()
                                    / expected.logits.abs().max()).item()}
    # The masks must matter, or the parity proves nothing: the loss without the window / without the packing.
    with torch.no_grad():
        if name == "mistral_sliding":
            result["windowless_loss"] = tiny("mistral", "sdpa", sliding_window=None)(**probe).loss.item()
        if name == "llama_eager":
            result["unpacked_loss"] = factory()(**{**probe, "position_ids": None}).loss.item()
    return result


def train_reference(model, length: int, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the mean loss over the dp batches of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = sum(model(**packed_batch(100 * step + d, length)).loss for d in range(dp)) / dp
        loss.backward()
        if step == 0:
            grads = full_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def refusals() -> dict[str, str]:
    """The one-line errors (each rank raises them alike)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = tiny("llama", "sdpa")
    apply_context_parallel(model, mesh["cp"])
    odd = packed_batch(1, 1001)
    padded = {**packed_batch(2, 64), "attention_mask": torch.ones(BATCH, 64, dtype=torch.long)}
    padded["attention_mask"][0, 50:] = 0
    three_heads = tiny("llama", "sdpa", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)

    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64))

    return {
        "length": error_of(lambda: model(**odd)),
        "heads": error_of(lambda: apply_context_parallel(three_heads, mesh["cp"])),
        "ring_cpu": error_of(lambda: apply_context_parallel(tiny("llama", "sdpa"), mesh["cp"], attention="ring")),
        "padding": error_of(lambda: model(**padded)),
        "family": error_of(lambda: apply_context_parallel(gpt2(), mesh["cp"])),
        "typo": error_of(lambda: apply_context_parallel(tiny("llama", "sdpa"), mesh["cp"], attention="all2all")),
        "twice": error_of(lambda: apply_context_parallel(model, mesh["cp"])),
        "all_ones_mask_ok": error_of(lambda: model(**{**packed_batch(3, 64),
                                                       "attention_mask": torch.ones(BATCH, 64, dtype=torch.long)})),
        "attention_changed": error_of(lambda: (model.set_attn_implementation("eager"), model(**packed_batch(4, 64)))),
    }


def layout() -> dict[str, Any]:
    """``local`` and ``gather`` of both attentions: which tokens a rank holds, and the round trip to natural order."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    tokens = torch.arange(8 * world).unsqueeze(0)  # (1, T)
    out = {}
    for attention in ("all_to_all", "ring"):
        ctx = ContextParallel(mesh, attention, "sdpa", None)
        mine = ctx.local(tokens)
        out[attention] = {"local": mine[0].tolist(), "round_trip": torch.equal(ctx.gather(mine), tokens)}
    # The ring's inputs, positions and labels as torch's load balancer shards them: the tokens local() names.
    ids = tokens.repeat(BATCH, 1) % VOCAB
    inputs, targets = ctx._shard_for_ring({"input_ids": ids}, shift_labels(ids))
    out["ring"]["shards_match_local"] = (torch.equal(inputs["input_ids"], ctx.local(ids))
                                         and torch.equal(inputs["position_ids"], ctx.local(tokens.expand_as(ids)))
                                         and torch.equal(targets, ctx.local(shift_labels(ids))))
    packed = {"input_ids": ids, "position_ids": (tokens % 5).expand_as(ids)}
    out["ring"]["packed"] = error_of(lambda: ctx._shard_for_ring(packed, None))
    return out


def main() -> None:
    dist.init_process_group("gloo")
    results = {}
    cases = sys.argv[2:]
    runs = {}
    for case in cases:  # every rank takes part in every parallel run
        start = time.perf_counter()
        runs[case] = refusals() if case == "refusals" else layout() if case == "layout" else run_case(case)
        results[case] = {"seconds": time.perf_counter() - start}
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, case in enumerate(cases):
        run = runs[case]
        if "losses" not in run:
            results[case].update(run)
            continue
        results[case].update({k: run[k] for k in ("losses", "cp", "dp_rank", "train_logits_shape", "eval_logits_shape",
                                                  "attached")})
        # Every rank holds the reduced gradients and the full logits: the references are spread over the ranks.
        if i % world == rank:
            start = time.perf_counter()
            results[case].update(compare(case, run), reference_seconds=time.perf_counter() - start)
    with open(f"{sys.argv[1]}.{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
