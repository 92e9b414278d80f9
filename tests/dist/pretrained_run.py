"""Fine-tuning from a pretrained Hugging Face folder under each strategy (Fabric), against one process in this script.

Usage: pretrained_run.py OUT SPEC [SPEC ...] -- MODEL [MODEL ...]    (MODEL: llama, qwen2, gemma2 (tied), phi3)

Rank 0 saves a tiny model of each family in bfloat16 (``save_pretrained``: config.json + model.safetensors) into a
shared folder. Per SPEC and model: the model is built empty (``fabric.init_module(empty_init=True)``), set up by the
strategy, and loaded with ``fabric.strategy.load_pretrained`` (each rank reading its own slices, converted to float32
slice by slice); then 5 SGD steps on the same batches as a one-process ``from_pretrained(dtype=float32)`` of the same
folder. Records both runs' losses and the tied parameters the folder held under another name.
"""

import os
import sys

import lightning as L
import torch

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, tmpdir, write_result  # noqa: E402

split = sys.argv.index("--")
specs, names = sys.argv[2:split], sys.argv[split + 1:]
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


def train(fabric, model, optimizer) -> list[float]:
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss, model=model) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def check(fabric: L.Fabric, name: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = folder_of(name)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_losses = train(None, reference, torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9))
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model = fabric.setup_module(model)
    tied = fabric.strategy.load_pretrained(model, folder)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    return {"losses": train(fabric, model, optimizer), "ref_losses": ref_losses, "tied": tied}


if int(os.environ.get("RANK", "0")) == 0:
    for name in names:
        build(name).to(torch.bfloat16).save_pretrained(folder_of(name))
results = {}
for spec in specs:
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=strategy_from_spec(spec, "fabric"))
    fabric.launch()
    fabric.barrier()  # rank 0 wrote the folders
    results[spec] = {name: check(fabric, name) for name in names}
write_result(results)
