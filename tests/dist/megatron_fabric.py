"""disttrain_megatron through Fabric on CPU/gloo. Usage: megatron_fabric.py OUT SPEC MODE [LAYERS]

MODE "train": a tiny Llama (LAYERS decoder layers) trains 3 steps on the data-parallel share of the global batch;
    writes the losses, this rank's parameter count, the loss after a save/resume round trip and an export.
MODE "clip": 3 steps with ``fabric.clip_gradients(max_norm=0.05)``; writes the losses and gradient norms and the
    same from one process clipping with torch.
MODE "schedules" (with pipeline_parallel_size=2): for each pipeline schedule and split of SCHEDULE_CASES, a new
    Fabric trains a 4-layer Llama 2 SGD steps on 4-sample batches; writes the stage bounds, the losses, the largest
    difference of this rank's gradients (step 1) and parameters (after step 1) from one process, and an evaluation
    loss; and the refusal of a ViT under "zbv". Modes join with "+" to run in one launch ("train+schedules").
MODE "tied" (with pipeline_parallel_size=2): a Qwen2 whose LM head is tied to its embedding, under 1F1B (the
    embedding on rank 0, the head on rank 1) and ZBV (both on rank 0), built on the meta device, loaded from an HF
    folder that has no ``lm_head.weight`` (HF leaves tied weights out), trained 3 SGD steps (momentum) with
    ``fabric.clip_gradients``; writes the losses and norms next to one process's, whether the head equals the
    embedding after set-up (before the load) and after training, and the trained state's largest difference. Then
    the 1F1B checkpoint after step 2 resumes under disttrain_fsdp, which saves it again (one optimizer state for
    the tied weight), and that resumes under 1F1B: the third step's loss and norm in each.
MODE "grads-llama" / "grads-vit": one forward and backward of a tiny Llama / timm ViT; writes the largest
    difference of logits and of every parameter's gradient from the same model run whole in this process.
"""

import copy
import os
import sys
from typing import Any

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    data_parallel_step, dataset, global_batch, probe_input, strategy_from_spec, tiny_llama, tmpdir, write_result)

spec, mode = sys.argv[2], sys.argv[3]
layers = int(sys.argv[4]) if len(sys.argv) > 4 else 2


def make_fabric() -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=strategy_from_spec(spec, "fabric"))
    fabric.launch()
    return fabric


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def tiny_vit(seed: int = 0, depth: int = 2):
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                             depth=depth, num_heads=4, num_classes=10)


def grads_check(fabric: L.Fabric, family: str) -> dict:
    from disttrain.parallel.families.layout import restore_rows

    model = tiny_llama(layers=layers) if family == "llama" else tiny_vit()
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    if family == "llama":
        inputs = probe_input()
        run = lambda m: m(input_ids=inputs, labels=inputs)  # noqa: E731
        out_ref = run(reference)
        out_ref.loss.backward()
        ref_logits = out_ref.logits
    else:
        inputs, target = torch.randn(4, 3, 32, 32), torch.tensor([1, 3, 5, 7])
        ref_logits = reference(inputs)
        torch.nn.functional.cross_entropy(ref_logits, target).backward()
    model = fabric.setup(model)
    if family == "llama":
        out = model(input_ids=inputs, labels=inputs)
        logits, loss = out.logits, out.loss
    else:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits, target)
    fabric.backward(loss)
    grads = {name.replace("_checkpoint_wrapped_module.", ""): full(p.grad) for name, p in
             model.module.named_parameters()}
    restore_rows(grads, fabric.strategy.engine.tp_result.reordered)
    ref_grads = dict(reference.named_parameters())
    grad_diff = max((grads[n] - ref_grads[n].grad).abs().max().item() for n in grads)
    return {"logits_diff": (full(logits) - ref_logits).abs().max().item(), "grad_diff": grad_diff,
            "params_compared": len(grads), "params_total": len(ref_grads)}


def train(fabric: L.Fabric) -> dict:
    engine = fabric.strategy.engine
    dp_mesh = engine.meshes.dp
    model = tiny_llama(layers=layers)
    total_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    ckpt = os.path.join(tmpdir(), "megatron-step2")

    def step(i: int) -> float:
        return data_parallel_step(fabric, model, optimizer, i, dp_mesh)

    losses = [step(i) for i in range(2)]
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": 2})
    losses.append(step(2))
    export = os.path.join(tmpdir(), "megatron-export.safetensors")
    fabric.strategy.export_full(model, export)

    # Resume from step 2 into a fresh model and optimizer: step 3 must give the same loss.
    fresh = tiny_llama(seed=5, layers=layers)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = fabric.setup(fresh, fresh_opt)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fabric.load(ckpt, state)
    model, optimizer = fresh, fresh_opt
    resumed = step(state["step"])
    return {"losses": losses, "resumed": resumed, "export": export, "local_params": local_params,
            "total_params": total_params}


def clip(fabric: L.Fabric, max_norm: float = 0.05) -> dict:
    dp_mesh = fabric.strategy.engine.meshes.dp
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()

    def run(model, optimizer, clip_fn, shard: slice) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for i in range(3):
            ids = global_batch(i, dp_size)[shard]
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss) if clip_fn is None else loss.backward()
            norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm) if clip_fn is None else clip_fn(model)
            optimizer.step()
            optimizer.zero_grad()
            value = loss.detach().clone()
            if clip_fn is None:  # the global batch's loss: the mean over the data-parallel ranks
                torch.distributed.all_reduce(value, group=dp_mesh.get_group())
                value /= dp_size
            losses.append(value.item())
            norms.append(norm.item())
        return losses, norms

    reference = tiny_llama(layers=layers)
    ref = run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2),
              lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm), slice(None))
    model = tiny_llama(layers=layers)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, norms = run(model, optimizer, None, slice(dp_rank, None, dp_size))
    return {"losses": losses, "norms": norms, "ref_losses": ref[0], "ref_norms": ref[1], "max_norm": max_norm}


# name: MegatronStrategy options (pipeline_parallel_size=2); "1f1b-split" is 1F1B at explicit split_points, the
# same model's other split: its losses equal the balanced split's.
SCHEDULE_CASES = {
    "1f1b": {"pipeline_schedule": "1f1b"},
    "1f1b-split": {"pipeline_schedule": "1f1b", "split_points": [1]},
    "interleaved_zero_bubble": {"pipeline_schedule": "interleaved_zero_bubble"},
    "zbv": {"pipeline_schedule": "zbv"},
    "dualpipev": {"pipeline_schedule": "dualpipev"},
}


def schedules(_: L.Fabric) -> dict:
    ids = dataset().tensors[0]
    batches = [ids[4 * i: 4 * i + 4] for i in range(3)]  # step 1, step 2, evaluation
    reference = tiny_llama(layers=4)
    # SGD: a parameter differs by lr x its gradient's difference (Adam's normalisation would magnify tiny ones)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for i in range(2):
        loss = reference(input_ids=batches[i], labels=batches[i]).loss
        loss.backward()
        if i == 0:
            ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        if i == 0:
            ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
        ref_losses.append(loss.item())
    with torch.no_grad():
        ref_eval = reference.eval()(input_ids=batches[2], labels=batches[2]).loss.item()
    out = {"ref_losses": ref_losses, "ref_eval": ref_eval}
    for name, options in SCHEDULE_CASES.items():
        fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                          strategy=disttrain.fabric.MegatronStrategy(pipeline_parallel_size=2, microbatches=4,
                                                                     **options))
        fabric.launch()
        model = tiny_llama(layers=4)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
        losses, grad_diff, param_diff = [], 0.0, 0.0
        for i in range(2):
            loss = model(input_ids=batches[i], labels=batches[i]).loss
            fabric.backward(loss)
            named = [(n, p) for n, p in model.module.named_parameters()]
            if i == 0:
                missing = [n for n, p in named if p.grad is None]
                assert not missing, f"{name}: no gradient for {missing}"
                grad_diff = max((full(p.grad) - ref_grads[n]).abs().max().item() for n, p in named)
            optimizer.step()
            optimizer.zero_grad()
            if i == 0:
                param_diff = max((full(p.detach()) - ref_params[n]).abs().max().item() for n, p in named)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            eval_loss = model(input_ids=batches[2], labels=batches[2]).loss.item()
        pipe = fabric.strategy.engine.pipeline
        out[name] = {"bounds": pipe.plan.bounds, "stages": pipe.stage_ids, "losses": losses, "eval": eval_loss,
                     "grad_diff": grad_diff, "param_diff": param_diff, "params": len(named)}
    # timm's ViT keeps cls_token/pos_embed outside its stages: the split backward would leave them without gradients
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=disttrain.fabric.MegatronStrategy(pipeline_parallel_size=2, pipeline_schedule="zbv"))
    fabric.launch()
    try:
        vit = tiny_vit(depth=4)
        fabric.setup(vit, torch.optim.SGD(vit.parameters(), lr=0.5))
    except ValueError as e:
        out["vit-zbv-refused"] = str(e)
    return out


def tied_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, attn_implementation="eager", use_cache=False))


TIED_CASES = {"tied-1f1b": "1f1b", "tied-zbv": "zbv"}
TIED_MAX_NORM = 0.5  # below every step's gradient norm: clipping is active, by the norm that counts the tie once


def tied(_: L.Fabric) -> dict:
    from safetensors.torch import load_file

    ids = dataset().tensors[0]
    batches = [ids[4 * i: 4 * i + 4] for i in range(3)]
    reference = tied_qwen2()
    folder = os.path.join(tmpdir(), "qwen2-tied")
    if int(os.environ["RANK"]) == 0:
        reference.save_pretrained(folder)
    torch.distributed.barrier()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    ref_losses, ref_norms = [], []
    for batch in batches:
        loss = reference(input_ids=batch, labels=batch).loss
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), TIED_MAX_NORM).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    ref_state = reference.state_dict()
    out: dict = {"ref_losses": ref_losses, "ref_norms": ref_norms, "max_norm": TIED_MAX_NORM,
                 "folder_has_head": "lm_head.weight" in load_file(os.path.join(folder, "model.safetensors"))}
    def set_up(strategy: Any) -> tuple[L.Fabric, Any, Any]:
        fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = tied_qwen2(seed=3)
        return fabric, *fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))

    def step(fabric: L.Fabric, model: Any, optimizer: Any, batch: torch.Tensor) -> tuple[float, float]:
        loss = model(input_ids=batch, labels=batch).loss  # under FSDP every rank reads the whole batch
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=TIED_MAX_NORM).item()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item(), norm

    pipeline = lambda schedule: disttrain.fabric.MegatronStrategy(  # noqa: E731
        pipeline_parallel_size=2, microbatches=4, pipeline_schedule=schedule)
    saved = os.path.join(tmpdir(), "tied-1f1b-step2")
    for name, schedule in TIED_CASES.items():
        fabric, model, optimizer = set_up(pipeline(schedule))
        path = os.path.join(tmpdir(), f"{name}.safetensors")

        def head_is_embedding() -> bool:
            fabric.strategy.export_full(model, path)
            state = load_file(path) if fabric.global_rank == 0 else {}
            return fabric.global_rank != 0 or torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])

        initialised_equal = head_is_embedding()  # each rank initialised its own copy on the meta device
        fabric.strategy.load_pretrained(model, folder)
        losses, norms = [], []
        for i, batch in enumerate(batches):
            if i == 2 and name == "tied-1f1b":
                fabric.save(saved, {"model": model, "optimizer": optimizer})
            loss, norm = step(fabric, model, optimizer, batch)
            losses.append(loss)
            norms.append(norm)
        trained_equal = head_is_embedding()
        state = load_file(path) if fabric.global_rank == 0 else ref_state
        out[name] = {"losses": losses, "norms": norms, "initialised_equal": initialised_equal,
                     "trained_equal": trained_equal, "stages": fabric.strategy.engine.pipeline.stage_ids,
                     "state_diff": max((state[k] - v).abs().max().item() for k, v in ref_state.items())}
    # across layouts: the pipeline's checkpoint (a head copy with its own momentum) into FSDP, FSDP's (one state
    # for the tied weight) into the pipeline
    fabric, model, optimizer = set_up(disttrain.fabric.FSDPStrategy())
    fabric.load(saved, {"model": model, "optimizer": optimizer})
    fabric.save(f"{saved}-fsdp", {"model": model, "optimizer": optimizer})
    out["pp-to-fsdp"] = step(fabric, model, optimizer, batches[2])
    fabric, model, optimizer = set_up(pipeline("1f1b"))
    fabric.load(f"{saved}-fsdp", {"model": model, "optimizer": optimizer})
    out["fsdp-to-pp"] = step(fabric, model, optimizer, batches[2])
    return {"tied": out}


fabric = make_fabric()
result = {}
for part in mode.split("+"):
    modes = {"train": train, "clip": clip, "schedules": schedules, "tied": tied}
    result.update(modes[part](fabric) if part in modes else grads_check(fabric, part.split("-")[1]))
write_result(result)
