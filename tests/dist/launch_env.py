"""What a rank sees of how it was started: torchrun's environment, argv, path, interpreter state, Lightning's view,
a collective, and its exit. tests/test_launcher.py runs it under torchrun and from the test zygotes and compares.
Usage: launch_env.py OUT MODE (MODE "ok"; "fail": rank 1 raises while rank 0 waits in a collective; "exit": each
rank leaves a file open with text in its buffer and a thread still working, and calls ``sys.exit(3)``)."""

# No ``from __future__ import annotations`` here: the annotations of the script's own code are evaluated, as
# python evaluates them (the "annotations" key).
import atexit
import os
import sys
import threading
import time

THREADS_AT_START = len(os.listdir("/proc/self/task"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric.plugins.environments import TorchElasticEnvironment  # noqa: E402
from lightning_utilities.core.rank_zero import rank_zero_only  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from common import write_result  # noqa: E402

LEFT_OPEN = []  # what the interpreter's shutdown must still flush
TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "OMP_NUM_THREADS")


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    rank_zero_at_import = rank_zero_only.rank
    first_random = torch.rand(3).tolist()  # before any seeding: a fresh interpreter starts from a random seed
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    if mode == "fail":
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails on purpose")
        dist.barrier()  # never completes: the launcher must stop this rank
    if mode == "exit":
        rank = dist.get_rank()
        dist.destroy_process_group()
        LEFT_OPEN.append(open(f"{out}.{rank}.open", "w"))
        LEFT_OPEN[0].write("written, never closed")

        def finish_later() -> None:
            time.sleep(0.5)
            with open(f"{out}.{rank}.thread", "w") as f:
                f.write("done")

        threading.Thread(target=finish_later).start()
        sys.exit(3)
    marker = f"{out}.{dist.get_rank()}.atexit"
    atexit.register(lambda: open(marker, "w").close())
    write_result({
        "env": {k: os.environ.get(k) for k in TORCHRUN_KEYS}, "argv": sys.argv[1:],
        "script_dir_first": sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "name": __name__,
        "cwd": os.getcwd(), "threads_at_start": THREADS_AT_START, "threads": threading.active_count(),
        "stdin_empty": sys.stdin.read() == "", "write_through": sys.stdout.write_through,
        "rank_zero_at_import": rank_zero_at_import, "elastic": dist.is_torchelastic_launched(),
        "lightning_elastic": TorchElasticEnvironment.detect(), "first_random": first_random,
        "hash": hash("disttrain"), "sum": total.item(), "session_leader": os.getsid(0) == os.getpid(),
        "marker": marker, "annotations": str(main.__annotations__),
    })
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
