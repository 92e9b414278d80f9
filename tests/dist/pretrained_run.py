"""Fine-tuning from a pretrained Hugging Face folder under each strategy (Fabric), against one process in this script.

Usage: pretrained_run.py OUT SPEC [SPEC ...] -- MODEL [MODEL ...] [--lora SPEC ...] [--trainer SPEC ...]
       (MODEL: llama, qwen2, gemma2 (tied), phi3)

Rank 0 saves a tiny model of each family in bfloat16 (``save_pretrained``: config.json + model.safetensors) into a
shared folder. Per SPEC and model: the model is built empty (``fabric.init_module(empty_init=True)``), set up by the
strategy, and loaded with ``fabric.strategy.load_pretrained`` (each rank reading its own slices, converted to float32
slice by slice); then 5 SGD steps on the same batches as a one-process ``from_pretrained(dtype=float32)`` of the same
folder. Records both runs' losses and the tied parameters the folder held under another name.

Per ``--lora`` SPEC, on the Llama folder: LoRA adapters (rank 4, every Linear) added to the empty model, the base
loaded sharded, the adapters' first values set (``init_adapters``), 3 SGD steps on the adapters only, a checkpoint,
2 more steps; then a fresh model resumed from the checkpoint (which holds the adapters and their optimizer state, not
the frozen base) repeats those 2 steps once the base folder is read again; before that, and with a changed copy of
the folder as base, the load is refused. Against one process with
peft's ``get_peft_model`` given the same first adapter values. Rank 0 then checks the exports: the base weights
untouched (equal to the folder's), peft's ``PeftModel.from_pretrained`` of the exported adapter folder and the
merged model both giving the trained model's logits.

Per ``--trainer`` SPEC: ``DialogueLM(pretrained=<Llama folder>, lora=...)`` under ``lightning.Trainer`` (the folder
read sharded in ``on_fit_start``), 3 steps: its first loss is the pretrained model's own (weights loaded, B zero),
the loss then falls, and only adapters changed; its checkpoint holds the adapters, and a fresh module restored from
it (the folder read in ``on_fit_start`` again) equals the trained one.
"""

import os
import shutil
import sys
from pathlib import Path

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)
from disttrain.parallel.split.lora import (LoraSettings, adapter_layers, add_lora, init_adapters, initial_adapters,
                                     split_export, write_adapter)

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, tmpdir, write_result  # noqa: E402

split = sys.argv.index("--")
trainer_at = sys.argv.index("--trainer") if "--trainer" in sys.argv else len(sys.argv)
lora_at = sys.argv.index("--lora") if "--lora" in sys.argv else trainer_at
specs, names = sys.argv[2:split], sys.argv[split + 1:lora_at]
lora_specs, trainer_specs = sys.argv[lora_at + 1:trainer_at], sys.argv[trainer_at + 1:]
VOCAB, SEQ, BATCH, STEPS = 96, 16, 4, 5


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**small, tie_word_embeddings=False))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**small, tie_word_embeddings=False))
    if name == "gemma2":  # tied embeddings: the folder holds the head once, under the embedding's name
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, head_dim=16, tie_word_embeddings=True))
    return tf.Phi3ForCausalLM(tf.Phi3Config(**small, pad_token_id=0, tie_word_embeddings=False))


def folder_of(name: str) -> str:
    return os.path.join(tmpdir(), f"pretrained-{name}")


def batch(step: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(50 + step))


def train(fabric, model, optimizer, steps=range(STEPS)) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss, model=model) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def check(fabric: L.Fabric, spec: str, name: str) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = folder_of(name)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_losses = train(None, reference, torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9))
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model = fabric.setup_module(model)
    fresh = os.path.join(tmpdir(), f"fresh-{spec.replace(':', '_')}-{name}.safetensors")
    fabric.strategy.export_full(model, fresh)  # the weights before the load: transformers' own initialisation?
    fabric.barrier()
    embedding = load_file(fresh)["model.embed_tokens.weight"]
    pad = AutoConfig.from_pretrained(folder).pad_token_id
    init = {"init_std": embedding.std().item(), "pad_row": embedding[pad].abs().max().item() if pad is not None else None}
    tied = fabric.strategy.load_pretrained(model, folder)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    return {"losses": train(fabric, model, optimizer), "ref_losses": ref_losses, "tied": tied, **init}


LORA = LoraSettings(rank=4, alpha=8, seed=3)


def lora_reference() -> tuple[list[float], torch.Tensor]:
    """One process, peft's own wrapper, the same first adapter values: (5 losses, logits after them)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder_of("llama"), dtype=torch.float32),
                           LORA.peft_config())
    first = initial_adapters(model.base_model.model, LORA.seed)
    with torch.no_grad():
        for name, param in model.base_model.model.named_parameters():
            if name in first:
                param.copy_(first[name])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    losses = train(None, model, optimizer)
    with torch.no_grad():
        return losses, model(input_ids=batch(99)).logits


def lora_model(fabric: L.Fabric):
    """Built uninitialised (transformers' no_init_weights: the base is read from the folder and the adapters get their
    first values, so nothing is initialised or, under zero.Init, broadcast)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with fabric.init_module(empty_init=True), no_init_weights():
        model = add_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder_of("llama")),
                                                          dtype=torch.float32), LORA)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5,
                                                        momentum=0.9))
    return model, optimizer


def checkpoint_size(path: str, key: str = "model") -> dict:
    """The model tensors a checkpoint holds and their bytes, next to the base folder's weights (the files on disk
    also hold the optimizer state and, in a model this small, mostly DCP's per-entry metadata)."""
    from disttrain.parallel.checkpoint.io import stored_entries

    model = {k[len(key) + 1:]: md for k, md in stored_entries(path).items() if k.startswith(f"{key}.")}
    return {"checkpoint_model_bytes": sum(md.size.numel() * md.properties.dtype.itemsize for md in model.values()),
            "base_bytes": (Path(folder_of("llama")) / "model.safetensors").stat().st_size,
            "checkpoint_model_keys": sorted(model)}


def changed_copy(fabric: L.Fabric, spec: str) -> str:
    """The Llama folder with one weight changed (another fine-tune of the same architecture)."""
    from safetensors.torch import load_file, save_file

    copy = os.path.join(tmpdir(), f"pretrained-llama-changed-{spec.replace(':', '_')}")
    if fabric.global_rank == 0:
        shutil.copytree(folder_of("llama"), copy)
        state = load_file(os.path.join(copy, "model.safetensors"))
        state["model.norm.weight"] = state["model.norm.weight"] * 2
        save_file(state, os.path.join(copy, "model.safetensors"), metadata={"format": "pt"})
    fabric.barrier()
    return copy


def load_error(fabric: L.Fabric, path: str, state: dict) -> str:
    from disttrain.parallel.checkpoint.integrity import CheckpointError

    try:
        fabric.load(path, state)
    except CheckpointError as e:
        return str(e)
    return ""


def check_lora(fabric: L.Fabric, spec: str) -> dict:
    from safetensors.torch import load_file

    ref_losses, ref_logits = lora_reference()
    model, optimizer = lora_model(fabric)
    tied = fabric.strategy.load_pretrained(model, folder_of("llama"))
    init_adapters(model.module, LORA.seed, lambda f: fabric.strategy.load_pretrained(model, f, partial=True))
    losses = train(fabric, model, optimizer, range(3))
    checkpoint = os.path.join(tmpdir(), f"lora-ckpt-{spec.replace(':', '_')}")
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    losses += train(fabric, model, optimizer, range(3, STEPS))
    full = os.path.join(tmpdir(), f"lora-full-{spec.replace(':', '_')}.safetensors")
    layers = adapter_layers(model.module)
    fabric.strategy.export_full(model, full)
    result = {"losses": losses, "ref_losses": ref_losses, "tied": tied, **checkpoint_size(checkpoint)}
    resumed, resumed_optimizer = lora_model(fabric)
    target = {"model": resumed, "optimizer": resumed_optimizer}
    result["no_base_error"] = load_error(fabric, checkpoint, target)  # the base is not loaded yet
    fabric.strategy.load_pretrained(resumed, changed_copy(fabric, spec))  # the same architecture, another weight
    result["other_base_error"] = load_error(fabric, checkpoint, target)
    fabric.strategy.load_pretrained(resumed, folder_of("llama"))  # a resume re-reads the base, then the checkpoint
    fabric.load(checkpoint, target)
    result["resumed"] = train(fabric, resumed, resumed_optimizer, range(3, STEPS))
    if fabric.global_rank == 0:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        state = load_file(full)
        stored = load_file(os.path.join(folder_of("llama"), "model.safetensors"))
        result["base_unchanged"] = all(torch.equal(state[k.replace(".weight", ".base_layer.weight")]
                                                   if k.replace(".weight", ".base_layer.weight") in state
                                                   else state[k], v.float()) for k, v in stored.items())
        adapter_dir = write_adapter(os.path.join(tmpdir(), f"lora-adapter-{spec.replace(':', '_')}"),
                                    split_export(state, layers, merge=False), LORA)
        base = AutoModelForCausalLM.from_pretrained(folder_of("llama"), dtype=torch.float32)
        with torch.no_grad():
            peft_logits = PeftModel.from_pretrained(base, str(adapter_dir))(input_ids=batch(99)).logits
            merged = AutoModelForCausalLM.from_pretrained(folder_of("llama"), dtype=torch.float32)
            merged.load_state_dict(split_export(state, layers, merge=True))
            merged_logits = merged(input_ids=batch(99)).logits
        scale = ref_logits.abs().max().item()
        result["adapter_logits_err"] = (peft_logits - ref_logits).abs().max().item() / scale
        result["merged_logits_err"] = (merged_logits - ref_logits).abs().max().item() / scale
    return result


def check_trainer_lora(spec: str) -> dict:
    from transformers import AutoModelForCausalLM

    from disttrain.nlp import DialogueLM

    positions = torch.arange(SEQ)
    rows = [{"input_ids": row, "labels": row, "position_ids": positions} for step in range(3) for row in batch(step)]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(folder_of("llama"), dtype=torch.float32)
        base_loss = base(input_ids=batch(0), labels=batch(0), position_ids=positions.expand(BATCH, -1)).loss.item()

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(outputs["loss"].item())

    losses = Losses()
    module = DialogueLM(pretrained=folder_of("llama"), lora=LORA.as_dict(), lr=5e-2, weight_decay=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=3,
                        strategy=strategy_from_spec(spec, "trainer"), callbacks=[losses], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, limit_val_batches=0)
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=BATCH))
    trainable = sorted({n.split(".")[-3] for n, p in module.named_parameters() if p.requires_grad})
    exported = os.path.join(tmpdir(), "trainer-lora.safetensors")
    trainer.strategy.export_full(exported, prefix="model.")
    trainer.strategy.barrier()
    from safetensors.torch import load_file

    state, stored = load_file(exported), load_file(os.path.join(folder_of("llama"), "model.safetensors"))
    base_equal = all(torch.equal(state[k.replace(".weight", ".base_layer.weight")] if
                                 k.replace(".weight", ".base_layer.weight") in state else state[k], v.float())
                     for k, v in stored.items())
    moved = max(state[k].abs().max().item() for k in state if ".lora_B." in k)
    checkpoint = os.path.join(tmpdir(), "trainer-lora-ckpt")
    trainer.save_checkpoint(checkpoint)
    # A fresh module restored from it (already at max_steps: nothing trains): the folder read again, then the adapters
    restored = DialogueLM(pretrained=folder_of("llama"), lora=LORA.as_dict(), lr=5e-2, weight_decay=0.0)
    again = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=3,
                      strategy=strategy_from_spec(spec, "trainer"), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      limit_val_batches=0)
    again.fit(restored, torch.utils.data.DataLoader(rows, batch_size=BATCH), ckpt_path=checkpoint)
    reexported = os.path.join(tmpdir(), "trainer-lora-restored.safetensors")
    again.strategy.export_full(reexported, prefix="model.")
    again.strategy.barrier()
    restored_state = load_file(reexported)
    return {"losses": losses.losses, "base_loss": base_loss, "trainable": trainable, "base_equal": base_equal,
            "lora_B_max": moved,
            "checkpoint_model_keys": checkpoint_size(checkpoint, "state_dict")["checkpoint_model_keys"],
            "restored_equal": restored_state.keys() == state.keys()
            and all(torch.equal(restored_state[k], state[k]) for k in state)}


if int(os.environ.get("RANK", "0")) == 0:
    for name in set(names) | ({"llama"} if lora_specs or trainer_specs else set()):
        build(name).to(torch.bfloat16).save_pretrained(folder_of(name))
results = {}
for spec in specs:
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=strategy_from_spec(spec, "fabric"))
    fabric.launch()
    fabric.barrier()  # rank 0 wrote the folders
    results[spec] = {name: check(fabric, spec, name) for name in names}
for spec in lora_specs:
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=strategy_from_spec(spec, "fabric"))
    fabric.launch()
    fabric.barrier()
    results[f"lora {spec}"] = check_lora(fabric, spec)
for spec in trainer_specs:
    results[f"trainer lora {spec}"] = check_trainer_lora(spec)
write_result(results)
