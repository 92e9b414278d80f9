"""DeepFM throughput on 2 CPU processes: rows/s of a raw torchrec loop (DMP, fused sparse optimizer, Adam, a plain
Python loop) against torchrec's own sparse-dist pipeline over the same DMP (``TrainPipelineSparseDist.progress``,
neither disttrain nor Lightning: what the overlap alone gives on this machine), our Trainer with disttrain_recsys,
its plain loop (pipeline="none") and torchrec's sparse-dist pipeline (pipeline="sparse_dist"), and Fabric with that
pipeline driving the loop (torchrec's own ``progress``, no Lightning loop around it), on the same data and model,
measured side by side in each round (fresh processes per round, the order rotated); then the bytes the tables'
all-to-alls send per step with comm_precision fp16 and bf16 against fp32; then the wall time of the daily job (a
fresh subprocess, conversion included) on a day of --daily-rows rows.

    python bench/deepfm_throughput.py                      # 100k rows, 5 rounds, a 1M-row daily job
    python bench/deepfm_throughput.py --rows 50000 --daily-rows 0   # throughput only, quick
    python bench/deepfm_throughput.py --smoke              # tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import parse_smoke, run_variants, write_ranks  # noqa: E402
from tables import write_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "recsys" / "deepfm_tiny.yaml"
DEVICES = 2
# the raw torchrec loop, torchrec's own pipeline over it, the Trainer's two pipelines, Fabric with torchrec's
# sparse-dist pipeline driving the loop
LOOPS = ("raw", "raw_pipeline", "none", "sparse_dist", "fabric_sparse_dist")
PRECISIONS = ("fp32", "fp16", "bf16")


class RankShare(torch.utils.data.Dataset):
    """Rank r's rows of each global batch (r::world), so every loop trains on the same rows."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return tuple(t[dist.get_rank()::dist.get_world_size()] for t in self.batches[i])


def dataset(data_file: Path, batch_size: int) -> RankShare:
    from disttrain.recsys.daily import load_recipe
    from disttrain.recsys.data import DayBatches, load_day

    day = load_day(data_file, data_file.parent / f"cache{dist.get_rank()}")
    sizes = load_recipe(CONFIG)["model"]["num_embeddings_per_feature"]
    return RankShare(DayBatches(day, slice(0, day.rows), batch_size * dist.get_world_size(), sizes))


class WithLoss(torch.nn.Module):
    """DeepFMNet and its loss as torchrec's pipeline takes a model: ``model(batch) -> (loss, output)``, the batch's
    fields named as the tables' network reads them."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net, self.loss_fn = net, torch.nn.BCEWithLogitsLoss()

    def forward(self, batch):
        return self.loss_fn(self.net(batch.dense, batch.sparse), batch.labels), None


def raw_model(net: torch.nn.Module, sparse_optimizer, lr: float):
    """``net`` in torchrec's DMP (our planner's plan and sharders, as disttrain_recsys gives them) and plain Adam
    over its dense parameters."""
    from torchrec.distributed import DistributedModelParallel

    from disttrain.parallel.engines.recsys import RecsysOptions, dense_parameters, fused_params, plan, sharders

    options = RecsysOptions()
    module_sharders = sharders(fused_params(options, sparse_optimizer))
    cpu = torch.device("cpu")
    model = DistributedModelParallel(net, device=cpu, sharders=module_sharders,
                                     plan=plan(net, options, dist.get_world_size(), cpu, module_sharders,
                                               dist.group.WORLD))
    return model, torch.optim.Adam(dense_parameters(model), lr=lr)


def raw_torchrec(data, model_config: dict, lr: float, warmup: int) -> tuple[int, float]:
    """torchrec's DMP and a plain loop: forward, BCE-with-logits, backward (tables step inside), Adam."""
    from disttrain.recsys.model import DeepFMNet, feature_names, to_kjt

    torch.manual_seed(0)
    net = DeepFMNet(**model_config)
    model, adam = raw_model(net, net.sparse_optimizer, lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    keys = feature_names()
    start, rows = 0.0, 0
    for i in range(len(data)):
        if i == warmup:
            dist.barrier()
            start, rows = time.perf_counter(), 0
        dense, sparse, labels = data[i]
        loss = loss_fn(model(dense, to_kjt(sparse, keys)), labels)
        loss.backward()
        adam.step()
        adam.zero_grad()
        rows += labels.shape[0]
    return rows, time.perf_counter() - start


def raw_torchrec_pipeline(data, model_config: dict, lr: float, warmup: int) -> tuple[int, float]:
    """torchrec's own ``TrainPipelineSparseDist`` over the raw loop's DMP and Adam (no disttrain strategy, no
    Lightning): ``progress`` runs forward, backward and the Adam step, the next batch's ids in flight meanwhile."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.streamable import Pipelineable

    from disttrain.parallel.engines.sparse_pipeline import TableBatch
    from disttrain.recsys.model import DeepFMNet

    Pipelineable.register(TableBatch)
    torch.manual_seed(0)
    net = DeepFMNet(**model_config)
    model, adam = raw_model(WithLoss(net), net.sparse_optimizer, lr)
    pipe = TrainPipelineSparseDist(model, adam, torch.device("cpu"))
    return timed_progress(pipe, data, warmup)


def timed_progress(pipe, data, warmup: int) -> tuple[int, float]:
    """torchrec's ``pipe.progress`` over ``data``'s batches until they run out, timed from batch ``warmup`` on."""
    from disttrain.recsys.model import table_batch

    batches = iter(map(table_batch, (data[i] for i in range(len(data)))))
    start, rows, step = 0.0, 0, 0
    while True:
        if step == warmup:
            dist.barrier()
            start, rows = time.perf_counter(), 0
        try:
            pipe.progress(batches)
        except StopIteration:
            break
        rows += data[step][2].shape[0] if step < len(data) else 0
        step += 1
    return rows, time.perf_counter() - start


def ours(data, model_config: dict, lr: float, warmup: int, **options) -> tuple[int, float, dict]:
    """The daily job's loop: Trainer(strategy=disttrain_recsys(**options)) over DeepFM, timed from batch ``warmup``
    on; returns (rows, seconds, bytes handed to the tables' all-to-alls per step)."""
    import lightning as L

    from disttrain.recsys.model import DeepFM
    from disttrain.strategies import RecsysStrategy

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                self.start, self.rows = time.perf_counter(), 0
                self.sent = trainer.strategy.engine.table_bytes()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx >= warmup:
                self.rows += batch[2].shape[0]
                self.end = time.perf_counter()

    torch.manual_seed(0)
    timer = Timer()
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    strategy = RecsysStrategy(**options)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[timer])
    trainer.fit(DeepFM(model_config, lr=lr), loader)
    steps = len(data) - warmup
    sent = {k: (v - timer.sent[k]) / steps for k, v in strategy.engine.table_bytes().items()}
    return timer.rows, timer.end - timer.start, sent


def fabric_loop(data, model_config: dict, lr: float, warmup: int, pipeline: str) -> tuple[int, float]:
    """Fabric with disttrain_recsys and torchrec's pipeline driving the loop (``fabric.strategy.train_pipeline``:
    forward, backward, dense Adam step), timed from batch ``warmup`` on."""
    import lightning as L

    from disttrain.fabric import RecsysStrategy
    from disttrain.parallel.engines.recsys import dense_parameters
    from disttrain.recsys.model import DeepFMNet

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=RecsysStrategy(pipeline=pipeline))
    fabric.launch()
    torch.manual_seed(0)
    net = DeepFMNet(**model_config)
    model, adam = fabric.setup(net, torch.optim.Adam(dense_parameters(net), lr=lr))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    pipe = fabric.strategy.train_pipeline(model, adam, lambda b: (loss_fn(model(b.dense, b.sparse), b.labels), None))
    return timed_progress(pipe, data, warmup)


def rank_main(args) -> None:
    """One launch (a rank under torchrun): the loops of one round in the given order, or the codecs."""
    import warnings

    from disttrain.recsys.daily import load_recipe

    import disttrain  # noqa: F401  (registers disttrain_recsys)

    warnings.filterwarnings("ignore")
    recipe = load_recipe(CONFIG)
    dist.init_process_group("gloo")
    data = dataset(Path(args.data), args.batch_size)
    warmup = min(3, len(data) - 1)
    model, lr = recipe["model"], recipe["train"]["lr"]
    out = {}
    if args.variant == "codecs":
        for precision in PRECISIONS:
            # Table- and column-wise tables send their pooled embeddings by all-to-all (row-wise ones reduce-scatter)
            out[precision] = ours(data, model, lr, warmup, comm_precision=precision,
                                  sharding_types=["table_wise", "column_wise"])[2]
    else:
        order = list(LOOPS[args.round % len(LOOPS):] + LOOPS[:args.round % len(LOOPS)])  # rotated each round
        for loop in order:
            if loop == "raw":
                rows, seconds = raw_torchrec(data, model, lr, warmup)
            elif loop == "raw_pipeline":
                rows, seconds = raw_torchrec_pipeline(data, model, lr, warmup)
            elif loop.startswith("fabric_"):
                rows, seconds = fabric_loop(data, model, lr, warmup, loop[len("fabric_"):])
            else:
                rows, seconds = ours(data, model, lr, warmup, pipeline=loop)[:2]
            out[loop] = (rows, seconds)
    write_ranks(args.result, out)
    dist.destroy_process_group()


def rows_per_s(ranks: list[dict], loop: str) -> float:
    """All ranks' rows over the slowest rank's seconds."""
    return sum(r[loop][0] for r in ranks) / max(r[loop][1] for r in ranks)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}, min {min(values):.3f}, max {max(values):.3f}"


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
    p.add_argument("--rows", type=int, default=100_000, help="rows of the throughput day")
    p.add_argument("--batch-size", type=int, default=1024, help="rows per rank and step")
    p.add_argument("--rounds", type=int, default=5, help="rounds (fresh processes each); the loops' order rotates")
    p.add_argument("--daily-rows", type=int, default=1_000_000, help="rows of the daily-job day (0: skip)")
    p.add_argument("--out-dir", default=None, help="where the Markdown + PNG table goes (default: bench/out)")
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = parse_smoke(p, rows=4096, batch_size=256, rounds=1, daily_rows=0)
    if args.result:
        return rank_main(args)

    from disttrain.recsys.synthetic import make_days

    with tempfile.TemporaryDirectory() as tmp:
        [day] = make_days(Path(tmp), 1, args.rows)
        base = [a for a in sys.argv[1:]]
        rounds = []
        for i in range(args.rounds):
            sys.argv[1:] = [*base, "--data", str(day), "--round", str(i)]
            rounds.append(run_variants(__file__, ["loops"], "--variant", DEVICES, 1)["loops"][0])
        sys.argv[1:] = [*base, "--data", str(day)]
        codecs = run_variants(__file__, ["codecs"], "--variant", DEVICES, 1)["codecs"][0]
        sys.argv[1:] = base
    rates = {loop: [rows_per_s(ranks, loop) for ranks in rounds] for loop in LOOPS}
    ratio = {loop: [rows_per_s(ranks, loop) / rows_per_s(ranks, "raw") for ranks in rounds] for loop in LOOPS}
    names = {"raw": "raw torchrec loop", "raw_pipeline": "torchrec's own pipeline", "none": "Trainer, pipeline=none",
             "sparse_dist": "Trainer, sparse_dist", "fabric_sparse_dist": "Fabric, sparse_dist"}
    print(f"throughput, {args.rows} rows, batch {args.batch_size} per rank, {DEVICES} CPU processes,"
          f" {args.rounds} rounds (ratios to the raw loop of the same round):")
    for loop in LOOPS:
        print(f"  {names[loop]:24s} {statistics.median(rates[loop]):10.0f} rows/s   ratio {spread(ratio[loop])}")
    embeddings = {p: statistics.mean(r[p]["embeddings"] for r in codecs) for p in PRECISIONS}
    ids = statistics.mean(r["fp32"]["ids"] for r in codecs)
    print("bytes handed to the tables' all-to-alls per step and rank, tables table- or column-wise (pooled"
          " embeddings + their gradients; ids):")
    for precision in PRECISIONS:
        print(f"  {precision}  embeddings {embeddings[precision]:10.0f}   ratio to fp32"
              f" {embeddings[precision] / embeddings['fp32']:.3f}   ids {ids:10.0f}  (target <= 0.5)")
    notes = [f"ratio: rows/s over the raw torchrec loop's in the same round, median of {args.rounds} rounds"
             " (target >= 1.0)",
             "all-to-all bytes per step and rank, pooled embeddings and their gradients: "
             + ", ".join(f"{p} {embeddings[p]:.0f}" for p in PRECISIONS) + f"; ids and lengths {ids:.0f}"]
    if args.daily_rows:
        with tempfile.TemporaryDirectory() as tmp:
            wall = daily_wall(Path(tmp), args.daily_rows)
        print(f"daily job, one {args.daily_rows}-row day, fresh process (conversion included): {wall:.1f} s"
              " (target <= 180 s)")
        notes.append(f"daily job, one {args.daily_rows}-row day, fresh process (conversion included): {wall:.1f} s"
                     " (target <= 180 s)")
    write_table("deepfm_throughput", "DeepFM training loops against a raw torchrec loop",
                f"{args.rows} rows, batch {args.batch_size} per rank, {DEVICES} CPU processes",
                ["loop", "rows/s", "ratio", "min", "max"],
                [[names[loop], statistics.median(rates[loop]), statistics.median(ratio[loop]), min(ratio[loop]),
                  max(ratio[loop])] for loop in LOOPS],
                bars=("rows/s", "ratio"), reference={"ratio": 1.0},
                fmt={"rows/s": ".0f", "ratio": ".3f", "min": ".3f", "max": ".3f"}, notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
