"""The per-rank bytes a real run holds, for ``tests/test_simulate.py`` to compare with ``disttrain.simulate``.

Usage: simulate_agree.py OUT CONFIG

On 2 gloo processes, the recipe's model is set up by the engines themselves (``disttrain_ddp``, ``disttrain_fsdp``,
then ``disttrain_megatron`` with tensor_parallel_size=2), materialised, trained one AdamW step on random tokens, and
the bytes of the local parameters (shards), their gradients and the optimizer's state tensors are recorded per rank.
Counted here independently of the simulation's own counting.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

from disttrain.parallel.engines.ddp import DDPEngine, DDPOptions  # noqa: E402
from disttrain.parallel.engines.fsdp import FSDPEngine  # noqa: E402
from disttrain.parallel.engines.megatron import MegatronEngine, MegatronOptions  # noqa: E402
from disttrain.parallel.split.fsdp import FSDPOptions  # noqa: E402
from disttrain.planner.spec import meta_model, recipe_model  # noqa: E402

out, config = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")


def size(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def real_bytes(engine) -> dict:
    model = meta_model(recipe_model(config))
    if isinstance(engine, DDPEngine):
        model = model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p.detach(), std=0.02)
        model = engine.wrap(model, torch.device("cpu"))
    else:
        engine.setup_mesh(dist.get_world_size(), torch.device("cpu"))
        engine.parallelize(model, torch.device("cpu"), "bf16-mixed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = getattr(model, "module", model).config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params),
            "optimizer": sum(size(v) for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)}


result = {"disttrain_ddp": real_bytes(DDPEngine(DDPOptions())),
          "disttrain_fsdp": real_bytes(FSDPEngine(FSDPOptions())),
          "disttrain_megatron": real_bytes(MegatronEngine(MegatronOptions(tensor_parallel_size=2)))}
write_result(result)
dist.destroy_process_group()
