"""A benchmark's table as Markdown and a PNG chart in ``bench/out/`` (git-ignored), so the docs can show the
latest figures. Each benchmark builds its rows once, prints them as before, and adds:

    from tables import write_table
    write_table("fsdp_overhead", "FSDP overhead", setup_line, ["variant", "ms/step", "ratio"], rows,
                bars=("ms/step", "ratio"), reference={"ratio": 1.0})

``bench/out/NAME.md`` holds the set-up line, the table, the chart and the command that produced it;
``bench/out/NAME.png`` one horizontal bar panel per charted column, the rows in table order.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def _cell(value: object, fmt: str) -> str:
    if isinstance(value, float):
        return format(value, fmt)
    return str(value).replace("|", "\\|")


def markdown(title: str, setup: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
             fmt: Mapping[str, str] | None = None, notes: Sequence[str] = (), image: str | None = None) -> str:
    """The Markdown page: title, set-up line, table (floats formatted with ``fmt[column]``, default ``.4g``), the
    chart (``image``, a path relative to the page), the notes, and how and where it was produced."""
    fmt = dict(fmt or {})
    lines = [f"# {title}", "", setup, "", "| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(columns)} columns {list(columns)!r}")
        lines.append("| " + " | ".join(_cell(v, fmt.get(c, ".4g")) for c, v in zip(columns, row)) + " |")
    if image:
        lines += ["", f"![{title}]({image})"]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    command = shlex.join(["python", os.path.relpath(sys.argv[0]) if sys.argv[0] else "?", *sys.argv[1:]])
    lines += ["", f"_`{command}` on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), {when}._", ""]
    return "\n".join(lines)


def chart(title: str, setup: str, columns: Sequence[str], rows: Sequence[Sequence[object]], bars: Sequence[str],
          reference: Mapping[str, float] | None = None):
    """A matplotlib Figure: one horizontal bar panel per column in ``bars`` (rows labelled by the first column, the
    first row on top), a dashed line at ``reference[column]`` where given (e.g. a ratio's 1.0 baseline)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    missing = [b for b in bars if b not in columns]
    if missing:
        raise ValueError(f"bars {missing!r} are not columns; the columns are {list(columns)!r}")
    labels = [str(r[0]) for r in rows]
    y = list(range(len(rows)))[::-1]
    fig = Figure(figsize=(4 + 3.2 * len(bars), 1.4 + 0.4 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(bars), sharey=True, squeeze=False)[0]
    for ax, column in zip(axes, bars):
        i = list(columns).index(column)
        values = [float(r[i]) if isinstance(r[i], (int, float)) else 0.0 for r in rows]
        ax.barh(y, values, color="#4c72b0", label=column)
        for yi, v in zip(y, values):
            ax.annotate(f" {v:.3g}", (v, yi), va="center", fontsize=8)
        if reference and column in reference:
            ax.axvline(reference[column], color="#c44e52", linestyle="--", linewidth=1)
        ax.set_title(column, fontsize=9)
        ax.set_xlim(0, max(values + [reference.get(column, 0.0) if reference else 0.0, 1e-12]) * 1.25)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels, fontsize=8)
    fig.suptitle(f"{title}\n{setup}", fontsize=9)
    return fig


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_table(name: str, title: str, setup: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
                bars: Sequence[str] = (), reference: Mapping[str, float] | None = None,
                fmt: Mapping[str, str] | None = None, notes: Sequence[str] = (),
                out_dir: str | os.PathLike | None = None) -> tuple[Path, Path | None]:
    """Write ``OUT/NAME.md`` and, when ``bars`` names columns to chart, ``OUT/NAME.png`` (``out_dir`` defaults to
    ``bench/out``; each file replaced only once complete). Returns the two paths (the PNG's None without bars)."""
    out = Path(out_dir) if out_dir is not None else OUT
    out.mkdir(parents=True, exist_ok=True)
    png = None
    if bars:
        fig = chart(title, setup, columns, rows, bars, reference)
        png = out / f"{name}.png"
        _atomic_write(png, lambda f: fig.savefig(f, format="png", dpi=110))
    md = out / f"{name}.md"
    text = markdown(title, setup, columns, rows, fmt, notes, png.name if png else None)
    _atomic_write(md, lambda f: f.write(text.encode()))
    print(f"wrote {md}" + (f" and {png}" if png else ""), flush=True)
    return md, png
