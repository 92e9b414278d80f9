"""Delta versions of the hourly DeepFM job, hour by hour on --devices CPU processes: each hour's published bytes
against the full version's, the share of table rows the hour changed, the delta's table rows against the bytes of the
rows that changed, and the whole delta against the target (1.1x the changed rows' bytes + the dense part).

    python bench/deepfm_deltas.py                  # 6 hours of 20,000 rows on 2 processes
    python bench/deepfm_deltas.py --smoke          # 3 hours of 1,500 rows: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import free_port, parse_smoke  # noqa: E402
from tables import write_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "recsys" / "deepfm_daily.py"


def run_hour(data: Path, models: Path, hour: str, devices: int) -> None:
    args = [str(RECIPE), "--data-root", str(data), "--model-root", str(models), "--accelerator", "cpu", "--every",
            "1h", "--run-date", hour, "--logger", "none", "--no-report", "--min-auc", "0", "--auc-tolerance", "1"]
    if devices > 1:
        args = ["-m", "torch.distributed.run", f"--nproc_per_node={devices}", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}", *args]
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"hour {hour} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")


def sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hours", type=int, default=6)
    p.add_argument("--rows", type=int, default=20000, help="rows per hour file")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out-dir", default=None, help="where the Markdown table goes (default: bench/out)")
    args = parse_smoke(p, hours=2, rows=1500, devices=1)
    from disttrain.recsys.delta import unpack_tree
    from disttrain.recsys.synthetic import make_days

    with tempfile.TemporaryDirectory(prefix="deepfm-deltas-") as tmp:
        data, models = Path(tmp) / "data", Path(tmp) / "models"
        paths = make_days(data, args.hours, args.rows, every="1h")
        hours = [path.name[len("day_"):-len(".tsv")] for path in paths]
        rows = []
        for hour in hours:
            run_hour(data, models, hour, args.devices)
            version = max(p for p in (models / "versions").iterdir() if p.name.isdigit())
            info = json.loads((version / "info.json").read_text())
            files = sizes(version)
            total = sum(files.values())
            if info["kind"] == "full":
                full = total
                rows.append([hour, version.name, "full", f"{total:,}", "1.000", "-", "-", "-", "-"])
                continue
            part = unpack_tree(torch.load(version / "dense.pt", weights_only=True))
            dense = sum(v.numel() * v.element_size() for v in part["dense"].values() if isinstance(v, torch.Tensor))
            table_bytes = sum(b for name, b in files.items() if name.startswith("rank"))
            changed = info["changed"]
            touched = changed["changed_rows"] * (int(info["model"]["embedding_dim"]) * 4 + 4)  # row + Adagrad value
            target = 1.1 * touched + 3 * dense  # the dense weights and Adam's two moments
            rows.append([hour, version.name, "delta", f"{total:,}", f"{total / full:.3f}",
                         f"{changed['fraction']:.1%}", f"{table_bytes / touched:.3f}", f"{files['dense.pt']:,}",
                         f"{total / target:.3f}"])
    columns = ["hour", "version", "kind", "bytes", "/ full", "rows changed", "rows / touched bytes", "dense.pt bytes",
               "/ target"]
    print(f"deepfm deltas: {args.hours} hour files of {args.rows} rows, {args.devices} CPU process(es)")
    for row in [columns] + rows:
        print("  " + "  ".join(f"{cell:>14s}" for cell in row))
    write_table("deepfm_deltas", "Hourly DeepFM: delta versions against the full version",
                f"{args.hours} hour files of {args.rows} rows, {args.devices} CPU process(es), deepfm_tiny.yaml",
                columns, rows,
                notes=["target: a delta <= 1.1x the bytes of the rows that changed (fp32 row + its row-wise Adagrad"
                       " value) + the dense weights with Adam's two moments; dense.pt also holds the run's metadata"
                       " (the id counts as the entries that changed since the base)"],
                out_dir=args.out_dir)


if __name__ == "__main__":
    main()
