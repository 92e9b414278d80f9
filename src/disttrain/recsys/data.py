"""Criteo-format click logs, one TSV file per day: parsing with bad-row counting, a one-time conversion of each
day to numpy files read back by memory mapping, hashing to the table sizes, and per-day train/held-out splits.

A row is ``label \\t 13 integer features \\t 26 categorical features (hex)``; an empty field is a missing value.
Files are ``day_YYYY-MM-DD.tsv`` or ``day_YYYY-MM-DD.tsv.gz`` (a day), or ``day_YYYY-MM-DD_HH.tsv[.gz]`` (an hour,
HH 00-23, for the hourly cadence). A file's period is named by its key: ``2026-11-29`` or ``2026-11-29_05``; keys
sort in time order.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT

from disttrain.parallel.guards.diskspace import ensure_free, writing
from disttrain.recsys.publish import fsync_dir

DAY_FILE = re.compile(r"^day_(\d{4}-\d{2}-\d{2})(?:_(\d{2}))?\.tsv(\.gz)?$")
PERIOD = re.compile(r"^(\d{4}-\d{2}-\d{2})(?:_(\d{2}))?$")
CADENCES = {"1d": "a day file (day_YYYY-MM-DD.tsv[.gz]) per run", "1h": "hour files (day_YYYY-MM-DD_HH.tsv[.gz])"}
COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
# Criteo's column names, used in messages: I1..I13 integer, C1..C26 categorical.
COLUMN_NAMES = [f"I{i + 1}" for i in range(INT_FEATURE_COUNT)] + [f"C{i + 1}" for i in range(CAT_FEATURE_COUNT)]
CACHE_VERSION = 2
STATS_FILE = "stats.json"
TOP_IDS = 1000  # most frequent ids kept per categorical column in a day's statistics (vocabulary overlap)
_HEX = re.compile(r"^[0-9a-fA-F]{1,16}$")
_HEX_IDS = re.compile(rf"^[0-9a-fA-F]{{0,16}}(?:\t[0-9a-fA-F]{{0,16}}){{{CAT_FEATURE_COUNT - 1}}}$")
_INT64_MAX = 2 ** 63 - 1
MISSING_INT = -2 ** 63  # a missing integer field as parsed (the transform maps it to 0, as any negative value)
_BAD_EXAMPLES = 3


class BadDataError(ValueError):
    """A day file that cannot be used (empty, truncated, too many malformed rows) or a data folder that breaks the
    layout; the message names the file (and the row where one is at fault) and what to do."""


def parse_date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"date {text!r} is not YYYY-MM-DD, e.g. 2026-11-29") from None


def parse_period(text: str) -> str:
    """A period key, ``YYYY-MM-DD`` (a day) or ``YYYY-MM-DD_HH`` (an hour, 00-23), checked and returned as is."""
    match = PERIOD.match(text.strip())
    hour = match.group(2) if match else None
    if match is None or (hour is not None and int(hour) > 23):
        raise ValueError(f"{text!r} is not YYYY-MM-DD (a day) or YYYY-MM-DD_HH (an hour 00-23), e.g. 2026-11-29 or"
                         " 2026-11-29_05")
    parse_date(match.group(1))
    return text.strip()


def period_start(key: str) -> dt.datetime:
    """When the period ``key`` starts (a day at 00:00)."""
    match = PERIOD.match(key)
    assert match is not None, key
    return dt.datetime.combine(parse_date(match.group(1)), dt.time(int(match.group(2) or 0)))


def period_key(when: dt.datetime, hourly: bool) -> str:
    return when.strftime("%Y-%m-%d_%H") if hourly else when.date().isoformat()


def is_hour(key: str) -> bool:
    return "_" in key


def list_periods(root: str | os.PathLike, every: str = "1d") -> dict[str, Path]:
    """``{key: file}`` for the files of the cadence ``every`` in ``root``: day files for ``1d``, hour files for
    ``1h`` (the other kind and other files are ignored)."""
    if every not in CADENCES:
        raise ValueError(f"every={every!r} is not a cadence; use " + " or ".join(f"{k} ({v})" for k, v in
                                                                               CADENCES.items()))
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data root {str(root)!r} is not a folder; pass the folder that holds the"
                                " day_YYYY-MM-DD[_HH].tsv files")
    periods: dict[str, Path] = {}
    for path in sorted(root.iterdir()):
        match = DAY_FILE.match(path.name)
        if not match or (match.group(2) is not None) != (every == "1h"):
            continue
        key = parse_period(match.group(1) + (f"_{match.group(2)}" if match.group(2) else ""))
        if key in periods:
            raise BadDataError(f"{key} has two files ({periods[key].name} and {path.name}); keep one")
        periods[key] = path
    return periods


def list_days(root: str | os.PathLike) -> dict[dt.date, Path]:
    """``{date: file}`` for every ``day_YYYY-MM-DD.tsv[.gz]`` in ``root`` (other files are ignored)."""
    return {parse_date(key): path for key, path in list_periods(root, "1d").items()}


@dataclass
class Day:
    """One day as arrays: ``labels`` (N,) float32, ``dense`` (N, 13) float32 (log(1 + x), missing -> 0),
    ``sparse`` (N, 26) int64 raw ids (the 64 bits of each hex id; missing -> 0; hashed to the table sizes per
    batch), the row counts and ``bad_examples``: up to three malformed rows as "line N: reason"."""

    date: dt.date
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    rows: int
    bad_rows: int
    bad_examples: tuple[str, ...] = ()
    hour: int | None = None  # an hour file's hour

    @property
    def key(self) -> str:
        """The period's key: ``2026-11-29`` or ``2026-11-29_05``."""
        return self.date.isoformat() + (f"_{self.hour:02d}" if self.hour is not None else "")

    @property
    def seed_offset(self) -> int:
        """A number per period that orders and separates periods (a day's is its ordinal, as before hours)."""
        return self.date.toordinal() if self.hour is None else self.date.toordinal() * 24 + self.hour

    @property
    def bad_fraction(self) -> float:
        return self.bad_rows / max(1, self.rows + self.bad_rows)


@dataclass
class ParsedDay:
    """What :func:`parse_day_file` read: the good rows' labels (N,), raw integer features (N, 13; a missing field
    is :data:`MISSING_INT`) and ids (N, 26; a missing field is 0), and the number of malformed rows with up to
    three examples ("line N: reason", N counted from 1 as editors and ``sed -n Np`` do)."""

    labels: np.ndarray
    ints: np.ndarray
    cats: np.ndarray
    bad_rows: int
    bad_examples: list[str]

    @property
    def missing(self) -> np.ndarray:
        """(39,) the number of missing fields per column: 13 integer, then 26 categorical."""
        return np.concatenate([(self.ints == MISSING_INT).sum(0), (self.cats == 0).sum(0)])


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8", errors="replace") if path.suffix == ".gz" \
        else open(path, encoding="utf-8", errors="replace")


def _parse_row(line: str) -> tuple[int, list[int], list[int]] | str:
    """One row's (label, 13 ints, 26 ids), or why the row is malformed (:func:`_why_malformed`)."""
    head = line.split("\t", 1 + INT_FEATURE_COUNT)  # label, 13 integers, then the 26 ids as one string
    # One regular expression over the 26 ids is several times faster than one match per id.
    if len(head) != 2 + INT_FEATURE_COUNT or head[0] not in ("0", "1") or not _HEX_IDS.match(head[-1]):
        return _why_malformed(line.split("\t"))
    try:
        ints = [int(x) if x else MISSING_INT for x in head[1:-1]]
    except ValueError:
        return _why_malformed(line.split("\t"))
    if max(ints) > _INT64_MAX or min(ints) < MISSING_INT:
        return _why_malformed(line.split("\t"))
    ids = [int(x, 16) if x else 0 for x in head[-1].split("\t")]
    if max(ids) > _INT64_MAX:  # 64-bit hashed ids keep their 64 bits in an int64; hashing reads them unsigned
        ids = [x - 2 ** 64 if x > _INT64_MAX else x for x in ids]
    return int(head[0]), ints, ids


def _why_malformed(fields: list[str]) -> str:
    """The first thing wrong with a row (the slow path of :func:`_parse_row`, taken for malformed rows only)."""
    if len(fields) != COLUMNS:
        return f"{len(fields)} tab-separated fields instead of {COLUMNS}"
    if fields[0] not in ("0", "1"):
        return f"label {fields[0][:20]!r} is not 0 or 1"
    for name, text in zip(COLUMN_NAMES, fields[1:1 + INT_FEATURE_COUNT]):
        try:
            value = int(text) if text else MISSING_INT
        except ValueError:
            return f"{name} holds {text[:20]!r}, not an integer"
        if not MISSING_INT <= value <= _INT64_MAX:
            return f"{name} value {text[:24]} is beyond int64"
    for name, text in zip(COLUMN_NAMES[INT_FEATURE_COUNT:], fields[1 + INT_FEATURE_COUNT:]):
        if text and not _HEX.match(text):
            return f"{name} holds {text[:20]!r}, not 1-16 hex digits"
    return "malformed"


def parse_day_file(path: str | os.PathLike) -> ParsedDay:
    """Read one TSV day (see :class:`ParsedDay`). A truncated or corrupt ``.gz`` raises :class:`BadDataError`
    naming the file and the last line read."""
    path = Path(path)
    labels, ints, cats, bad, examples = [], [], [], 0, []
    number = 0
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, start=1):
                line = line.rstrip("\n").rstrip("\r")
                if not line:
                    continue
                row = _parse_row(line)
                if isinstance(row, str):
                    bad += 1
                    if len(examples) < _BAD_EXAMPLES:
                        examples.append(f"line {number}: {row}")
                    continue
                labels.append(row[0])
                ints.append(row[1])
                cats.append(row[2])
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        if isinstance(e, gzip.BadGzipFile) and number == 0:
            raise BadDataError(f"{path.name} is not a gzip file ({e}); copy it again from its source (or name it"
                               " .tsv if it is plain text)") from None
        what = "truncated" if isinstance(e, EOFError) else "corrupt"
        raise BadDataError(f"{path.name} is {what} after line {number} ({e}); copy the file again from its"
                           " source") from None
    return ParsedDay(labels=np.asarray(labels, dtype=np.float32),
                     ints=np.asarray(ints, dtype=np.int64).reshape(-1, INT_FEATURE_COUNT),
                     cats=np.asarray(cats, dtype=np.int64).reshape(-1, CAT_FEATURE_COUNT),
                     bad_rows=bad, bad_examples=examples)


def dense_transform(ints: np.ndarray) -> np.ndarray:
    """Criteo's usual transform: log(1 + x), negatives (a few columns have -1, -2) clipped to 0."""
    return np.log1p(np.clip(ints, 0, None)).astype(np.float32)


def hash_ids(ids: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Raw ids (N, F) int64 holding 64-bit ids -> rows of each feature's table: the unsigned id modulo the size."""
    return (ids.view(np.uint64) % sizes.astype(np.uint64)).astype(np.int64)


def day_statistics(parsed: ParsedDay, dense: np.ndarray, top_ids: int = TOP_IDS) -> dict:
    """The statistics a day is validated by against the days before it (see :mod:`disttrain.recsys.validate`):
    row count, label rate, per column the share of missing fields, per integer column the mean and standard
    deviation of the values the model sees (log(1 + x), missing as 0), and per categorical column its ``top_ids``
    most frequent ids (missing fields left out) with their counts."""
    rows = len(parsed.labels)
    stats: dict = {"rows": rows, "label_rate": float(parsed.labels.mean()) if rows else 0.0,
                   "missing": {name: float(count) / max(rows, 1) for name, count in zip(COLUMN_NAMES, parsed.missing)},
                   "dense_mean": {}, "dense_std": {}, "top_ids": {}}
    for k, name in enumerate(COLUMN_NAMES[:INT_FEATURE_COUNT]):
        column = dense[:, k].astype(np.float64)
        stats["dense_mean"][name] = float(column.mean()) if rows else 0.0
        stats["dense_std"][name] = float(column.std()) if rows else 0.0
    for k, name in enumerate(COLUMN_NAMES[INT_FEATURE_COUNT:]):
        ids, counts = np.unique(parsed.cats[:, k], return_counts=True)
        ids, counts = ids[ids != 0], counts[ids != 0]  # id 0 stands for a missing field
        order = np.argsort(-counts, kind="stable")[:top_ids]
        stats["top_ids"][name] = [[int(i), int(c)] for i, c in zip(ids[order], counts[order])]
    return stats


def _source_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"version": CACHE_VERSION, "source": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cached(path: str | os.PathLike, cache_root: str | os.PathLike) -> bool:
    """Whether the day file ``path`` is converted in ``cache_root`` as it is now (same size and time)."""
    path = Path(path)
    meta_file = Path(cache_root) / path.name.split(".")[0] / "meta.json"
    if not meta_file.is_file():
        return False
    stamp = _source_stamp(path)
    meta = json.loads(meta_file.read_text())
    return {k: meta.get(k) for k in stamp} == stamp


# Bytes of the converted cache per byte of Criteo TSV text: about 283 bytes a row (label, 13 float32, 26 int64, the
# .npy headers and statistics) against 263 bytes of text a row in the demo days (1.08) and about 230 in Criteo's own
# days (45 GB for 195M rows: 1.23); rounded up.
CACHE_PER_TEXT_BYTE = 1.3


def cache_size_estimate(path: str | os.PathLike) -> int:
    """About how many bytes :func:`convert_day` writes for ``path``, from its text size (a ``.gz``'s uncompressed
    size is in its last 4 bytes, modulo 4 GiB: a larger day is estimated from its compressed size times 4)."""
    path = Path(path)
    size = path.stat().st_size
    if path.suffix == ".gz" and size >= 4:
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            text = int.from_bytes(f.read(4), "little")
        size = max(text, 4 * size)
    return int(size * CACHE_PER_TEXT_BYTE)


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


def convert_day(path: str | os.PathLike, cache_root: str | os.PathLike) -> Path:
    """Convert a day file once to ``cache_root/<name>/{labels,dense,sparse}.npy`` + ``stats.json`` + ``meta.json``
    (written to a temporary folder and renamed, so a crash never leaves a half-converted day); reused while the
    source file's size and modification time are unchanged. Returns the folder."""
    path = Path(path)
    out = Path(cache_root) / path.name.split(".")[0]
    if cached(path, cache_root):
        return out
    stamp = _source_stamp(path)
    parsed = parse_day_file(path)
    dense = dense_transform(parsed.ints)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    arrays = (("labels", parsed.labels), ("dense", dense), ("sparse", parsed.cats))
    what = f"the converted cache of {path.name}"
    ensure_free(out, sum(a.nbytes for _, a in arrays), what, "free space there or move --model-root to a larger"
                " disk (the cache lives in MODEL_ROOT/cache)")
    with writing(out, what, "cache", cleanup=tmp):
        tmp.mkdir(parents=True)
        for name, array in arrays:
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, array)
                f.flush()
                os.fsync(f.fileno())
        (tmp / STATS_FILE).write_text(json.dumps(day_statistics(parsed, dense)))
        (tmp / "meta.json").write_text(json.dumps({**stamp, "rows": int(len(parsed.labels)),
                                                   "bad_rows": parsed.bad_rows, "bad_examples": parsed.bad_examples}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    fsync_dir(out.parent)
    return out


def load_day(path: str | os.PathLike, cache_root: str | os.PathLike, max_bad_fraction: float = 0.01) -> Day:
    """A day's arrays (memory-mapped from the converted cache). Raises :class:`BadDataError` for an empty day or
    when the share of malformed rows passes ``max_bad_fraction``."""
    path = Path(path)
    match = DAY_FILE.match(path.name)
    if not match:
        raise ValueError(f"{path.name!r} is not named day_YYYY-MM-DD[_HH].tsv or day_YYYY-MM-DD[_HH].tsv.gz")
    folder = convert_day(path, cache_root)
    meta = json.loads((folder / "meta.json").read_text())
    day = Day(date=parse_date(match.group(1)), hour=int(match.group(2)) if match.group(2) else None,
              rows=meta["rows"], bad_rows=meta["bad_rows"],
              bad_examples=tuple(meta.get("bad_examples", ())),
              **{name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("labels", "dense", "sparse")})
    if day.rows == 0 and day.bad_rows == 0:
        raise BadDataError(f"day file {path.name} is empty (no rows); replace it with the day's export, or remove it"
                           " and rerun with --skip-missing-days to go on without that day")
    if day.rows == 0 or day.bad_fraction > max_bad_fraction:
        raise BadDataError(
            f"{path.name}: {day.bad_rows} of {day.rows + day.bad_rows} rows are malformed"
            f" ({day.bad_fraction:.2%} > max_bad_fraction={max_bad_fraction:.2%}; {'; '.join(day.bad_examples)});"
            " fix or replace the file, or raise the threshold (--max-bad-fraction) if the rows can be dropped")
    return day


def day_stats(path: str | os.PathLike, cache_root: str | os.PathLike) -> dict:
    """The statistics of a day file (see :func:`day_statistics`), from its converted cache (converted if needed)."""
    return json.loads((convert_day(path, cache_root) / STATS_FILE).read_text())


def split_rows(rows: int, eval_fraction: float) -> tuple[slice, slice]:
    """(train rows, held-out rows): the last ``eval_fraction`` of a day is held out from training."""
    held = int(round(rows * eval_fraction))
    return slice(0, rows - held), slice(rows - held, rows)


class DayBatches(torch.utils.data.Dataset):
    """Contiguous batches of a row range of a day, as ``(dense, sparse hashed to the table sizes, labels)``
    tensors; item i is batch i (use ``DataLoader(batch_size=None)``). Contiguous reads keep the memory map
    sequential; shuffle the batch order with the sampler. ``drop_last`` leaves out a final partial batch (several
    processes: torchrec's collectives on gloo need the same batch size on every rank)."""

    def __init__(self, day: Day, rows: slice, batch_size: int, table_sizes: Sequence[int],
                 drop_last: bool = False) -> None:
        if len(table_sizes) != day.sparse.shape[1]:
            raise ValueError(f"the model has {len(table_sizes)} tables but the data has {day.sparse.shape[1]}"
                             " categorical columns; set num_embeddings_per_feature to one size per column")
        self.day, self.batch_size = day, batch_size
        self.start, self.stop = rows.start or 0, rows.stop
        self.sizes = np.asarray(table_sizes, dtype=np.int64)
        self.drop_last = drop_last

    def __len__(self) -> int:
        rows = self.stop - self.start
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    @property
    def rows(self) -> int:
        return min(len(self) * self.batch_size, self.stop - self.start)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo = self.start + index * self.batch_size
        hi = min(lo + self.batch_size, self.stop)
        sparse = hash_ids(np.asarray(self.day.sparse[lo:hi]), self.sizes)
        return (torch.from_numpy(np.array(self.day.dense[lo:hi])), torch.from_numpy(sparse),
                torch.from_numpy(np.array(self.day.labels[lo:hi])))


