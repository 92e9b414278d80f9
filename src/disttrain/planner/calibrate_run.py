"""Run by ``disttrain calibrate`` in every process (``disttrain run``'s launcher): measure this machine over the
process group and write rank 0's calibration, from the first process of every node (over several nodes each node's
``disttrain calibrate`` reads it there).

Usage: calibrate_run.py OUT SHAPES_JSON MODELS_JSON [--quick]   (SHAPES_JSON: extra [m, n, k] matmul shapes, e.g. a
model's; MODELS_JSON: models to time, ``[{"model": mapping, "micro_batch", "seq_len"}]``; --quick: the links, matmul and
memory only, fewer sizes, one repeat)
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from disttrain.planner.calibrate import measure_here, save


def main() -> None:
    out, shapes, models = sys.argv[1], [tuple(s) for s in json.loads(sys.argv[2])], json.loads(sys.argv[3])
    cuda = torch.cuda.is_available() and os.environ.get("LT_ACCELERATOR") not in ("cpu",)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        calibration = measure_here(device, shapes, quick="--quick" in sys.argv[4:], models=models)
        if calibration.nodes > 1:  # every node writes rank 0's figures (its own are its ranks' alone)
            found = [calibration]
            dist.broadcast_object_list(found, src=0)
            calibration = found[0]
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            save(calibration, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
