"""DeepFM throughput: rows/s of our training loop (Trainer + disttrain_recsys) against a raw torchrec loop (DMP,
fused sparse optimizer, Adam, a plain Python loop) on the same data and model, in one process; then the wall
time of the daily job (a fresh subprocess, conversion included) on a day of --daily-rows rows.

    python bench/deepfm_throughput.py                      # 200k rows for throughput, a 1M-row daily job
    python bench/deepfm_throughput.py --rows 50000 --daily-rows 0   # throughput only, quick
    python bench/deepfm_throughput.py --smoke              # tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_smoke  # noqa: E402
from tables import write_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "recsys" / "deepfm_tiny.yaml"


def init_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def dataset(folder: Path, rows: int, batch_size: int):
    from disttrain.recsys.daily import load_recipe
    from disttrain.recsys.data import DayBatches, load_day
    from disttrain.recsys.synthetic import make_days

    path = make_days(folder, 1, rows)[0]
    day = load_day(path, folder / "cache")
    sizes = load_recipe(CONFIG)["model"]["num_embeddings_per_feature"]
    return DayBatches(day, slice(0, day.rows), batch_size, sizes)


def raw_torchrec(data, model_config: dict, lr: float, warmup: int) -> float:
    """torchrec's DMP and a plain loop: forward, BCE-with-logits, backward (tables step inside), Adam."""
    from torchrec.distributed import DistributedModelParallel

    from disttrain.parallel.engines.recsys import RecsysOptions, dense_parameters, fused_params, plan, sharders
    from disttrain.recsys.model import DeepFMNet, feature_names, to_kjt

    torch.manual_seed(0)
    net = DeepFMNet(**model_config)
    options = RecsysOptions()
    module_sharders = sharders(fused_params(options, net.sparse_optimizer))
    model = DistributedModelParallel(net, device=torch.device("cpu"), sharders=module_sharders,
                                     plan=plan(net, options, 1, torch.device("cpu"), module_sharders, dist.group.WORLD))
    adam = torch.optim.Adam(dense_parameters(model), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    keys = feature_names()
    start, rows = 0.0, 0
    for i in range(len(data)):
        if i == warmup:
            start, rows = time.perf_counter(), 0
        dense, sparse, labels = data[i]
        loss = loss_fn(model(dense, to_kjt(sparse, keys)), labels)
        loss.backward()
        adam.step()
        adam.zero_grad()
        rows += labels.shape[0]
    return rows / (time.perf_counter() - start)


def ours(data, model_config: dict, lr: float, warmup: int) -> float:
    """The daily job's loop: Trainer(strategy="disttrain_recsys") over DeepFM, timed from batch ``warmup`` on."""
    import lightning as L

    from disttrain.recsys.model import DeepFM

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                self.start, self.rows = time.perf_counter(), 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx >= warmup:
                self.rows += batch[2].shape[0]
                self.end = time.perf_counter()

    torch.manual_seed(0)
    timer = Timer()
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    trainer = L.Trainer(strategy="disttrain_recsys", accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(DeepFM(model_config, lr=lr), loader)
    return timer.rows / (timer.end - timer.start)


def daily_wall(folder: Path, rows: int) -> float:
    from disttrain.recsys.synthetic import make_days

    make_days(folder / "data", 1, rows)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "recipes" / "recsys" / "deepfm_daily.py"), "--data-root",
                    str(folder / "data"), "--model-root", str(folder / "models"), "--accelerator", "cpu"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000, help="rows of the throughput day")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each is reported")
    p.add_argument("--daily-rows", type=int, default=1_000_000, help="rows of the daily-job day (0: skip)")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    args = parse_smoke(p, rows=4096, batch_size=512, rounds=1, daily_rows=0)

    from disttrain.recsys.daily import load_recipe

    import disttrain  # noqa: F401  (registers disttrain_recsys)

    recipe = load_recipe(CONFIG)
    init_group()
    with tempfile.TemporaryDirectory() as tmp:
        data = dataset(Path(tmp), args.rows, args.batch_size)
        warmup = min(3, len(data) - 1)
        raw, our = [], []
        for _ in range(args.rounds):
            raw.append(raw_torchrec(data, recipe["model"], recipe["train"]["lr"], warmup))
            our.append(ours(data, recipe["model"], recipe["train"]["lr"], warmup))
        print(f"throughput, {args.rows} rows, batch {args.batch_size}, 1 CPU process (best of {args.rounds}):")
        print(f"  raw torchrec loop  {max(raw):10.0f} rows/s   (rounds: {', '.join(f'{r:.0f}' for r in raw)})")
        print(f"  disttrain Trainer  {max(our):10.0f} rows/s   (rounds: {', '.join(f'{r:.0f}' for r in our)})")
        print(f"  ratio ours/raw     {max(our) / max(raw):10.3f}      (target >= 0.95)")
    dist.destroy_process_group()
    notes = [f"ratio: best rows/s of {args.rounds} alternating rounds over the raw loop's (target >= 0.95)"]
    if args.daily_rows:
        with tempfile.TemporaryDirectory() as tmp:
            wall = daily_wall(Path(tmp), args.daily_rows)
        print(f"daily job, one {args.daily_rows}-row day, fresh process (conversion included): {wall:.1f} s"
              " (target <= 180 s)")
        notes.append(f"daily job, one {args.daily_rows}-row day, fresh process (conversion included): {wall:.1f} s"
                     " (target <= 180 s)")
    write_table("deepfm_throughput", "DeepFM training loop against a raw torchrec loop",
                f"{args.rows} rows, batch {args.batch_size}, 1 CPU process", ["loop", "rows/s", "ratio"],
                [["raw torchrec loop", max(raw), 1.0], ["disttrain Trainer", max(our), max(our) / max(raw)]],
                bars=("rows/s", "ratio"), reference={"ratio": 1.0}, fmt={"rows/s": ".0f", "ratio": ".3f"}, notes=notes,
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
