"""Users' own loops and models on 2 CPU processes, one launch for several checks. Usage:
user_loops.py OUT STRATEGY [STRATEGY ...] ("ddp" is Lightning's own reference; PARTS and SKIP say what runs).

Per strategy: Lightning's GAN (manual optimization, two optimizers) under the Trainer; the same GAN under Fabric
set up as two modules and (disttrain only) as one container; a timm classifier fitted by the Trainer and then
called after fit; a peft-wrapped Qwen2 fitted and saved with ``save_pretrained`` (peft's and transformers') by rank 0
inside ``full_model()``. ModelCheckpoint folders are left for ``load_from_checkpoint`` in the test's own process.
Each part records its error instead of ending the run, so every test reports its own failure."""

import os
import sys
import traceback
from contextlib import nullcontext
from functools import partial

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

import disttrain  # noqa: F401  (registers the disttrain_* names)

sys.path.insert(0, os.path.dirname(__file__))
from common import tmpdir, write_result  # noqa: E402
from user_modules import (  # noqa: E402
    GAN,
    Classifier,
    Generator,
    Pair,
    PeftLM,
    adversarial_losses,
    discriminator,
    gan_loader,
    image_data,
    mean_over_ranks,
    probe_images,
    probe_latent,
    probe_tokens,
    token_data,
)

GAN_HIDDEN = 24  # not the default: load_from_checkpoint must restore it from the saved hyperparameters
CLASSIFIER_LR = 3e-3


def trainer_for(strategy: str, ckpt_dir: str | None = None, *, manual: bool = False) -> L.Trainer:
    if strategy == "ddp" and manual:
        # Toggling leaves one network without gradients in each backward: Lightning's DDP needs to know.
        strategy = "ddp_find_unused_parameters_true"
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     enable_checkpointing=bool(ckpt_dir))


def checkpoint_in(folder: str) -> str:
    (name,) = [n for n in os.listdir(folder) if not n.startswith(".")]
    return os.path.join(folder, name)


def trainer_gan(strategy: str) -> dict:
    torch.manual_seed(0)
    module = GAN(hidden=GAN_HIDDEN)
    ckpt_dir = os.path.join(tmpdir(), f"gan-{strategy}")
    trainer = trainer_for(strategy, None if strategy == "ddp" else ckpt_dir, manual=True)
    trainer.fit(module, gan_loader())
    result = {"g": module.g_losses, "d": module.d_losses}
    if strategy != "ddp":
        with trainer.strategy.full_model():
            result["probe"] = module.generator(probe_latent()).tolist()
        result["checkpoint"] = checkpoint_in(ckpt_dir)
    return result


def fabric_gan(strategy: str, one_module: bool) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    generator, disc = Generator(GAN_HIDDEN), discriminator(GAN_HIDDEN)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999))
    if one_module:
        pair, opt_g, opt_d = fabric.setup(Pair(generator, disc), opt_g, opt_d)
        generator, disc = pair.generator, pair.discriminator
    else:
        generator, opt_g = fabric.setup(generator, opt_g)
        disc, opt_d = fabric.setup(disc, opt_d)
    g_losses, d_losses = [], []
    for real, z in fabric.setup_dataloaders(gan_loader()):
        g_loss, d_loss = adversarial_losses(generator, disc, real, z)
        loss = g_loss()
        fabric.backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()  # the generator's loss also left gradients on the discriminator
        g_losses.append(mean_over_ranks(loss))
        loss = d_loss()
        fabric.backward(loss)
        opt_d.step()
        opt_d.zero_grad()
        d_losses.append(mean_over_ranks(loss))
    result = {"g": g_losses, "d": d_losses}
    if one_module:
        sample = pair(probe_latent())  # the whole container after its parts were called on their own
        with fabric.strategy.full_model(pair):
            result["sample_matches"] = torch.allclose(sample, pair.generator(probe_latent()))
    return result


def classifier_after_fit(strategy: str) -> dict:
    """Fit, then call the model as a user would in a notebook or an evaluation script."""
    torch.manual_seed(0)
    module = Classifier(lr=CLASSIFIER_LR)
    ckpt_dir = os.path.join(tmpdir(), f"classifier-{strategy}")
    trainer = trainer_for(strategy, None if strategy == "ddp" else ckpt_dir)
    trainer.fit(module, torch.utils.data.DataLoader(image_data(), batch_size=4, shuffle=True))
    images = probe_images()
    result = {"losses": module.losses}
    with torch.no_grad():
        result["called_directly"] = module.model(images).tolist()  # on every rank: the unit gathers around it
        result["called_through_module"] = module(images).tolist()
    if strategy == "ddp":
        return result
    rank = trainer.global_rank
    with trainer.strategy.full_model():
        if rank == 0:  # no communication inside: rank 1 does nothing meanwhile
            result["full_model"] = module.model(images).tolist()
            result["head_only"] = module.model.forward_head(module.model.forward_features(images)).tolist()
    try:
        module.model.head.fc(torch.zeros(1, module.model.head.fc.in_features))  # a layer called outside its unit
    except RuntimeError as e:
        result["outside_unit_error"] = str(e)
    export = os.path.join(tmpdir(), f"classifier-{strategy}.safetensors")
    trainer.strategy.export_full(export, prefix="model.")
    if rank == 0:
        plain = Classifier().model
        plain.load_state_dict(load_file(export))
        with torch.no_grad():
            result["export"] = plain(images).tolist()
    result["checkpoint"] = checkpoint_in(ckpt_dir)
    return result


def peft_saved(strategy: str) -> dict:
    """A peft model fitted, then saved as peft's and transformers' docs show, by rank 0 inside ``full_model()``
    (Lightning's ddp: no block, every rank already holds the whole model). The folders are compared in the test."""
    torch.manual_seed(0)
    module = PeftLM()
    trainer = trainer_for(strategy)
    trainer.fit(module, torch.utils.data.DataLoader(token_data(), batch_size=4, shuffle=True))
    folder = os.path.join(tmpdir(), f"peft-{strategy}")
    result = {"losses": module.losses, "adapters": f"{folder}/adapters", "whole": f"{folder}/whole"}
    block = nullcontext() if strategy == "ddp" else trainer.strategy.full_model()
    with block:
        if trainer.is_global_zero:  # rank 0 alone: nothing inside may communicate
            state = module.model.state_dict()
            result["state_types"] = sorted({type(v).__name__ for v in state.values()})
            result["state_shapes"] = {k: list(v.shape) for k, v in state.items()}
            module.model.save_pretrained(result["adapters"])  # peft: the adapters and adapter_config.json
            module.model.get_base_model().save_pretrained(result["whole"])  # transformers: every tensor
            with torch.no_grad():
                result["logits"] = module.model(input_ids=probe_tokens()).logits.tolist()
    with torch.no_grad():  # the shards are back: a collective call after the block, on every rank
        result["logits_after"] = module.model(input_ids=probe_tokens()).logits.tolist()
    return result


def attempt(part, *args) -> dict:
    try:
        return part(*args)
    except Exception as e:  # recorded for the test that reads this part
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


PARTS = {  # what runs under which strategy ("ddp": Lightning's reference)
    "trainer_gan": trainer_gan,
    "fabric_gan": partial(fabric_gan, one_module=False),
    "fabric_pair": partial(fabric_gan, one_module=True),  # no DDP counterpart: DDP syncs only what runs in forward
    "classifier": classifier_after_fit,
    "peft": peft_saved,
}
SKIP = {"ddp": {"fabric_pair"}, "disttrain_ddp": {"trainer_gan", "fabric_gan", "fabric_pair", "peft"},
        "disttrain_fsdp_offload": {"classifier", "peft"}, "disttrain_megatron": {"classifier", "peft"}}
results = {strategy: {name: attempt(run, strategy) for name, run in PARTS.items()
                      if name not in SKIP.get(strategy, ())} for strategy in sys.argv[2:]}
write_result(results)
