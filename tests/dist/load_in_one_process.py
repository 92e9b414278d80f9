"""A fresh plain process (no torch.distributed, no GPU) that loads Trainer checkpoint folders the way users do:
``MyModule.load_from_checkpoint(folder)``. Usage: load_in_one_process.py OUT.json CLASS=FOLDER [CLASS=FOLDER ...]
with CLASS one of GAN, Classifier; writes the restored hyperparameters and the outputs on the probe inputs."""

import json
import os
import sys

import torch
import torch.distributed as dist

import disttrain  # noqa: F401  (lets load_from_checkpoint read disttrain checkpoint folders)

sys.path.insert(0, os.path.dirname(__file__))
from user_modules import GAN, Classifier, probe_images, probe_latent  # noqa: E402

results = {}
for spec in sys.argv[2:]:
    name, folder = spec.split("=", 1)
    module = {"GAN": GAN, "Classifier": Classifier}[name].load_from_checkpoint(folder)
    module.eval()
    with torch.no_grad():
        out = module.generator(probe_latent()) if name == "GAN" else module.model(probe_images())
    results[folder] = {"hparams": dict(module.hparams), "out": out.tolist(), "device": str(out.device)}
results["distributed"] = dist.is_initialized()
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
