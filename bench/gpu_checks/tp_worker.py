"""One rank of the tp=2 check (``gpu_checks/megatron.py``), started by torchrun: both ranks on the same device
(``cuda:0``, or the CPU in a dry run) with the gloo backend.

Usage: tp_worker.py RESULT DEVICE_TYPE MODEL_JSON STEPS SEQ. Each rank trains the unsharded reference and the
tensor-parallel copy (``disttrain.parallel.split.tp.apply_tp`` with the Llama plan) from the same weights on the same
batches, and writes RESULT.<rank>.json: both loss curves and the shape of its q_proj shard, or the error."""

from __future__ import annotations

import copy
import json
import sys
import traceback

import torch
import torch.distributed as dist


def main() -> None:
    result, device_type, model_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    steps, seq = int(sys.argv[4]), int(sys.argv[5])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict = {}
    try:
        out = run(device_type, model_args, steps, seq)
    except Exception as e:  # noqa: BLE001  (reported to the parent, which says why the check did not run)
        out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
               "traceback": traceback.format_exc()[-3000:]}
    with open(f"{result}.{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run(device_type: str, model_args: dict, steps: int, seq: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from disttrain.parallel.split.tp import apply_tp

    if device_type == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one device
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    config = LlamaConfig(**model_args, use_cache=False, attn_implementation="sdpa")
    with torch.device(device):
        reference = LlamaForCausalLM(config)
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model_args["vocab_size"], (4, seq), generator=g).to(device) for _ in range(steps)]
    ref_losses = _train(reference, batches)
    # The mesh over the existing gloo group: init_device_mesh("cuda") could create an NCCL group, which refuses two
    # ranks on one device.
    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("tp",))
    apply_tp(model, mesh)
    q = model.model.layers[0].self_attn.q_proj.weight
    local = q.to_local() if hasattr(q, "to_local") else q
    losses = _train(model, batches)
    return {"losses": losses, "reference": ref_losses, "local_rows": int(local.shape[0]),
            "full_rows": int(q.shape[0]), "sharded": int(local.shape[0]) * 2 == int(q.shape[0]),
            "device": str(local.device)}


def _train(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.item()))
    return losses


if __name__ == "__main__":
    main()
