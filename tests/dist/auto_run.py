"""``disttrain_auto`` on 2 CPU processes. Usage: auto_run.py OUT ENTRY [DEVICE_MEMORY]

ENTRY "trainer": ``Trainer(strategy=...)`` with the tiny Llama built in ``configure_model``; "trainer-name": the
plain string "disttrain_auto"; "fabric": ``Fabric(strategy=AutoStrategy(model=<its config dict>))``. Each rank
writes the chosen strategy class, its registered name, the plan's choice and the training losses."""

import os
import sys

import lightning as L
import torch

import disttrain
from disttrain.parallel import rank_state_bytes

sys.path.insert(0, os.path.dirname(__file__))
from common import LlamaModule, fabric_train, loader, tiny_llama, write_result  # noqa: E402

entry = sys.argv[2]
memory = sys.argv[3] if len(sys.argv) > 3 else None
# With little memory (e.g. 1.8MB per rank for the tiny Llama) a full replica no longer fits: the choice must shard.
options = {"device_memory": memory, "headroom": 0.0, "micro_batch": 2, "seq_len": 16} if memory else {}

if entry.startswith("trainer"):
    strategy = "disttrain_auto" if entry == "trainer-name" else disttrain.strategies.AutoStrategy(**options)
    # as the README shows: the module builds its model in configure_model, so the planner measures a meta copy
    module = LlamaModule(build_in_configure=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader())
    chosen, losses, model = trainer.strategy, module.losses, module.model
else:
    config = tiny_llama().config.to_dict()
    fabric = L.Fabric(accelerator="cpu", devices=2,
                      strategy=disttrain.fabric.AutoStrategy(model=config, **{"micro_batch": 2, "seq_len": 16,
                                                                              **options}))
    fabric.launch()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    chosen, losses = fabric.strategy, fabric_train(fabric, model, optimizer, 3)

write_result({"class": chosen.__class__.__module__ + "." + chosen.__class__.__name__,  # the chosen class
              "choice": chosen.plan.strategy, "losses": losses,
              "param_bytes": rank_state_bytes(model)["params"]})
