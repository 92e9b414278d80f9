"""disttrain_megatron through the Trainer on CPU/gloo, with training_step written for one process.

Usage: megatron_trainer.py OUT SPEC MODEL [resume]    (MODEL: "llama", "gpt2" (untied) or "vit")
Trains 3 steps (one process computes the reference in the same script), validates under the strategy, exports
the full model and compares it with the reference model's state dict. "resume" (llama): saves a checkpoint after
the 3 steps (one epoch) and resumes it in a new Trainer for step 4.
"""

import copy
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import VOCAB, dataset, strategy_from_spec, tiny_llama, tmpdir, write_result  # noqa: E402

spec, family = sys.argv[2], sys.argv[3]
resume = sys.argv[4:] == ["resume"]
STEPS, BATCH = 3, 4


def tiny_vit():
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=32,
                             depth=4, num_heads=4, num_classes=5)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False))


LM = family in ("llama", "gpt2")  # HF causal LMs: the loss comes from labels


def data() -> TensorDataset:
    if LM:
        return dataset()
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(24, 3, 16, 16, generator=g), torch.randint(0, 5, (24,), generator=g))


class Module(L.LightningModule):
    """Written for one process: nothing here knows about stages."""

    def __init__(self) -> None:
        super().__init__()
        self.model = {"llama": lambda: tiny_llama(layers=4), "gpt2": tiny_gpt2, "vit": tiny_vit}[family]()
        self.losses: list[float] = []

    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # the PP hook (ViT)
        return F.cross_entropy(logits, target)

    def step_loss(self, batch) -> torch.Tensor:
        if LM:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.step_loss(batch)
        self.log("train_loss", loss)
        global_loss = loss.detach().clone()  # the mean over data-parallel ranks = the global batch's loss
        dp = self.trainer.strategy.engine.meshes.dp
        torch.distributed.all_reduce(global_loss, group=dp.get_group())
        self.losses.append(global_loss.item() / dp.size())
        return loss

    def validation_step(self, batch, batch_idx):
        # a count summed over the data-parallel ranks (each replica's tp/pp/cp ranks see the same batch)
        self.log("val_samples", float(len(batch[0])), reduce_fx="sum", sync_dist=True)
        if LM:
            self.log("val_loss", self.step_loss(batch), sync_dist=True)
        else:
            x, y = batch
            logits = self.model(x)
            self.log("val_loss", self.loss_fn(logits, y), sync_dist=True)
            self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        # SGD: exports comparable to 1e-6. The ViT's in foreach, torch's default on GPUs: under pipeline parallelism its
        # class token stays a plain tensor beside the stages' DTensors (the engine steps that group tensor by tensor).
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, foreach=True if family == "vit" else None)


CLIP = 0.1  # gradient_clip_val, below every step's gradient norm: the whole model's norm must be used
ref_norms: list[float] = []


def reference(model: Module, dp: int) -> tuple[list[float], float, dict]:
    """One process, the global batches of ``dp`` data-parallel ranks: losses, the validation loss as the Trainer
    logs it, the trained weights. (The Trainer's DistributedSampler shuffles training data with seed 0 + epoch even
    for an unshuffled loader: the ranks' k-th batches together are the k-th slice of that order, the last one partial
    when the ranks' shares do not fill their batches; validation is in order, rank r taking every dp-th sample, and
    its loss is the mean over samples.)"""
    opt = model.configure_optimizers()

    def epoch(seed: int) -> list:
        order = torch.randperm(len(data()), generator=torch.Generator().manual_seed(seed))
        return list(DataLoader(torch.utils.data.Subset(data(), order.tolist()), batch_size=BATCH * dp))

    train_batches = [batch for seed in range(STEPS + 1) for batch in epoch(seed)]
    batches = [b for r in range(dp) for b in DataLoader(torch.utils.data.Subset(data(), range(r, len(data()), dp)),
                                                         batch_size=BATCH)]
    losses = []

    def train(batch) -> None:
        loss = model.step_loss(batch)
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    for batch in train_batches[:STEPS]:
        train(batch)
    with torch.no_grad():  # Lightning weighs each batch's logged loss by its samples
        val = sum(model.step_loss(b).item() * len(b[0]) for b in batches) / sum(len(b[0]) for b in batches)
    state = {k: v.detach().clone() for k, v in model.model.state_dict().items()}
    if resume:  # step 4, in a new Trainer
        train(train_batches[STEPS])
    return losses, val, state


module = Module()
initial = copy.deepcopy(module)


def make_trainer(steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=steps,
                     strategy=strategy_from_spec(spec, "trainer"), gradient_clip_val=CLIP, logger=False,
                     enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


trainer = make_trainer(STEPS)
trainer.fit(module, train_dataloaders=DataLoader(data(), batch_size=BATCH))
validated = trainer.validate(module, dataloaders=DataLoader(data(), batch_size=BATCH), verbose=False)[0]
val = validated["val_loss"]
dp_ranks = trainer.strategy.engine.dims.dp  # the DistributedSampler pads every data-parallel rank to an equal share
samples = {"logged": validated["val_samples"], "seen": dp_ranks * -(-len(data()) // dp_ranks)}
# Lightning's votes (ModelCheckpoint, EarlyStopping) count every process, whichever ranks logged values combine over
vote = trainer.strategy.reduce_boolean_decision
votes = [vote(True), vote(trainer.global_rank == 0, all=False), vote(trainer.global_rank == 0)]

ref_losses, ref_val, ref_state = reference(initial, trainer.strategy.engine.dims.dp)
export = os.path.join(tmpdir(), f"trainer-{family}.safetensors")
trainer.strategy.export_full(export, prefix="model.")
diff = None
if trainer.global_rank == 0:
    from safetensors.torch import load_file

    exported = load_file(export)
    assert sorted(exported) == sorted(ref_state), (sorted(set(exported) ^ set(ref_state)))
    diff = max((exported[k] - ref_state[k]).abs().max().item() for k in ref_state)
resumed = None
if resume:
    ckpt = os.path.join(tmpdir(), "megatron-trainer.ckpt")
    trainer.save_checkpoint(ckpt)
    again = Module()  # fresh weights: everything must come from the checkpoint
    make_trainer(STEPS + 1).fit(again, train_dataloaders=DataLoader(data(), batch_size=BATCH), ckpt_path=ckpt)
    resumed = again.losses
write_result({"samples": samples, "votes": votes, "resumed": resumed, "losses": module.losses, "ref_losses": ref_losses, "val": val, "ref_val": ref_val,
              "export_diff": diff, "ref_norms": ref_norms, "clip": CLIP, "local_params": sum(getattr(p, "_local_tensor", p).numel() for p in module.parameters())})
