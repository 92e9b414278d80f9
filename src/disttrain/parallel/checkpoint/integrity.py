"""Checkpoint integrity: content checksums in a manifest, and a DCP reader that is safe on folders you did not write.

A checkpoint folder's ``manifest.json`` lists every file with its size and a checksum (xxh3-128) of each 64 MiB chunk. Each
rank hashes the shard files it writes while it writes them (:class:`ChecksumWriter`); rank 0 adds the files it
wrote itself and writes the manifest last (:func:`write_manifest`), so a manifest marks a finished checkpoint.

:class:`CheckpointReader` is what every disttrain load path hands to ``dcp.load``: it checks ``.metadata`` against
the manifest and unpickles it admitting only DCP's metadata classes, hashes every shard file it reads from (ahead of
the reads, on a thread pool) and never deserializes a byte before its chunk matched, and admits non-tensor items
only when ``torch.load(weights_only=True)`` accepts them. :func:`verify_checkpoint` checks a whole folder offline.

Why xxh3-128 (the ``xxhash`` package): checksums here catch corruption (bit rot, torn or overwritten files), they are
not a signature, so a cryptographic hash buys nothing: ``bench/checkpoint_checksum.py`` measured sha256 at ~0.7-1.8
GB/s per core (SHA-NI), which more than doubled a page-cache save (~1 GB/s), and xxh3-128 at ~8 GB/s on the same
core. Saves hash the bytes as they are written (no second read); loads hash chunks on a few threads ahead of DCP's
reads. Manifests written with sha256 (the first version) still verify: the manifest names its hash. Checksums catch corruption; they are not a signature:
whoever can rewrite a checkpoint can rewrite its manifest, which is why ``.metadata`` is also unpickled
restrictively.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from disttrain.parallel.guards.diskspace import fail_point

MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"
HASH = "xxh3_128"  # what new manifests use; HASHES is what verification accepts


def _sha256() -> Any:
    return hashlib.sha256()


def _xxh3_128() -> Any:
    import xxhash

    return xxhash.xxh3_128()


HASHES = {"xxh3_128": _xxh3_128, "sha256": _sha256}
CHUNK_BYTES = 64 << 20  # the unit hashed in parallel and verified before a read
_READ_BYTES = 16 << 20  # per pread/update: fewer hand-overs of the GIL between writer and hashers
_FORMAT = "disttrain-manifest"
FIX = "resume from an earlier checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint written before disttrain wrote checksums: it loads, but its contents cannot be verified."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _hash_threads() -> int:
    # Ranks of one node share its cores: a few hashing threads each is what overlapping the I/O needs.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local)))


def _digest(fd: int, start: int, length: int, algo: str = HASH) -> str:
    h = HASHES[algo]()
    end = start + length
    while start < end:
        block = os.pread(fd, min(_READ_BYTES, end - start), start)
        if not block:  # shorter than expected: the digest will not match
            break
        h.update(block)
        start += len(block)
    return h.hexdigest()


def hash_file(path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES, algo: str = HASH) -> dict[str, Any]:
    """``{"bytes": size, algo: [one hex digest per chunk]}`` of a file (its manifest entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        starts = range(0, size, chunk_bytes) if size else [0]
        return {"bytes": size, algo: [_digest(fd, s, min(chunk_bytes, size - s), algo) for s in starts]}
    finally:
        os.close(fd)


# -- writing ---------------------------------------------------------------------------------------------------
class _HashingStream:
    """The file object DCP writes a shard through: passes every write on and hashes the bytes on the way, chunk by
    chunk, in the writing thread (measured cheaper than reading them back on other threads, which only pays off
    with idle cores and otherwise costs a copy and hand-overs of the GIL)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.position = raw, 0
        self.digests: list[str] = []
        self._chunk = HASHES[HASH]()

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        view = memoryview(data).cast("B")[:written]
        while len(view):
            part = view[:CHUNK_BYTES - self.position % CHUNK_BYTES]
            self._chunk.update(part)
            self.position += len(part)
            view = view[len(part):]
            if self.position % CHUNK_BYTES == 0:
                self.digests.append(self._chunk.hexdigest())
                self._chunk = HASHES[HASH]()
        return written

    def entry(self) -> dict[str, Any]:
        """The manifest entry of what was written: as :func:`hash_file` computes it from the file."""
        if self.position % CHUNK_BYTES or not self.digests:
            self.digests.append(self._chunk.hexdigest())
        return {"bytes": self.position, HASH: self.digests}

    def tell(self) -> int:
        return self.position

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # flush, fileno (fsync), close
        return getattr(self.raw, name)


class _HashingFileSystem(FileSystem):
    def __init__(self, digests: dict[str, Any]) -> None:
        super().__init__()
        self.digests = digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = Path(path)
        with super().create_stream(path, mode) as stream:
            if "w" not in mode or path.suffix != ".distcp":  # .metadata is hashed by write_manifest
                yield stream
                return
            fail_point("shard", path)
            hashing = _HashingStream(stream)
            yield hashing
        self.digests[path.name] = hashing.entry()


class ChecksumWriter(FileSystemWriter):
    """``dcp.save(state, storage_writer=ChecksumWriter(folder))``: DCP's FileSystemWriter that also hashes every
    shard file it writes, while writing it; then pass ``writer.digests`` to :func:`write_manifest`."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.digests: dict[str, Any] = {}
        self.fs = _HashingFileSystem(self.digests)


def write_manifest(folder: str | os.PathLike, digests: dict[str, Any], group: Any = None) -> Path:
    """Collective (over ``group``, default all ranks): gather every rank's shard digests; rank 0 hashes the other
    files of ``folder`` (``.metadata``, ``meta.pt``: everything present that no rank hashed) and writes
    ``manifest.json`` last, which marks the checkpoint finished. Call after every file of the checkpoint is
    written."""
    folder = Path(folder)
    gathered = [digests]
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digests, group=group)
    error: Optional[Exception] = None
    if _rank() == 0:
        files: dict[str, Any] = {}
        for part in gathered:
            files.update(part or {})
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.name not in files and path.name != MANIFEST_FILE:
                files[path.name] = hash_file(path)
        manifest = {"format": _FORMAT, "version": 1, "hash": HASH, "chunk_bytes": CHUNK_BYTES,
                    "files": dict(sorted(files.items()))}
        tmp = folder / f".{MANIFEST_FILE}.tmp"
        try:
            fail_point("manifest", tmp)
            tmp.write_text(json.dumps(manifest, indent=1) + "\n")
            os.replace(tmp, folder / MANIFEST_FILE)
        except OSError as e:  # a full disk: every rank raises it (none waits for the manifest in a collective)
            error = e
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, 0, group=group)
        error = box[0]
    if error is not None:
        raise error
    return folder / MANIFEST_FILE


# -- reading ---------------------------------------------------------------------------------------------------
def read_manifest(folder: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The folder's manifest, or None for a checkpoint written before checksums (no manifest.json)."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        ok = manifest.get("format") == _FORMAT and manifest.get("hash") in HASHES and isinstance(manifest["files"], dict)
        int(manifest["chunk_bytes"])
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(folder)!r} is corrupt: {MANIFEST_FILE} is unreadable ({e});"
                              f" {FIX}") from e
    if not ok:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {MANIFEST_FILE} is not a disttrain manifest (hash"
                              f" {manifest.get('hash')!r}; known: {', '.join(HASHES)}); {FIX}")
    return manifest


_warned: set[str] = set()


def warn_unverified(folder: str | os.PathLike, written_by: Optional[str] = None) -> None:
    """Say once per process and folder (on rank 0) that a checkpoint without a manifest is loaded unverified.
    ``written_by``: the library that wrote it (no manifest ever), else it predates disttrain's checksums."""
    key = str(Path(folder).resolve())
    if key in _warned or _rank() != 0:
        return
    _warned.add(key)
    why = f"written by {written_by}" if written_by else "written before disttrain stored checksums"
    warnings.warn(f"checkpoint {str(folder)!r} has no {MANIFEST_FILE} ({why}): loading it without verifying its"
                  " contents; the next save writes checksums", UnverifiedCheckpointWarning, stacklevel=3)


def _corrupt(folder: Path, name: str, detail: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(folder)!r} is corrupt: cannot read {name} ({detail}); {FIX}")


def _mismatch(folder: Path, name: str, chunk: int, chunk_bytes: int, size: int, algo: str) -> CheckpointError:
    first = chunk * chunk_bytes
    last = min(size, first + chunk_bytes) - 1
    return _corrupt(folder, name, f"bytes {first}-{last} do not match their {algo} in {MANIFEST_FILE}: changed after"
                                  " it was saved")


def _size_error(folder: Path, name: str, actual: Optional[int], expected: int) -> CheckpointError:
    if actual is None:
        return CheckpointError(f"checkpoint {str(folder)!r} is incomplete: {name} is missing (listed in"
                               f" {MANIFEST_FILE}); {FIX}")
    return _corrupt(folder, name, f"it has {actual} bytes, {MANIFEST_FILE} says {expected}: truncated or"
                                  " overwritten")


def _entry(folder: Path, manifest: dict[str, Any], name: str) -> dict[str, Any]:
    entry = manifest["files"].get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get(manifest["hash"]), list):
        raise _corrupt(folder, name, f"it is not listed in {MANIFEST_FILE}")
    return entry


def _bytes_problem(folder: str | os.PathLike, name: str, data: bytes,
                  manifest: Optional[dict[str, Any]] = None) -> Optional[str]:
    """What is wrong with a small file's bytes, already read, against its manifest entry ("has 16 bytes, manifest.json
    says 1145 ..."), or None (also when there is no manifest: nothing to check)."""
    folder = Path(folder)
    manifest = read_manifest(folder) if manifest is None else manifest
    if manifest is None:
        return None
    if name not in manifest["files"]:
        return f"it is not listed in {MANIFEST_FILE}"
    entry, step, algo = _entry(folder, manifest, name), int(manifest["chunk_bytes"]), manifest["hash"]
    if len(data) != entry["bytes"]:
        return f"it has {len(data)} bytes, {MANIFEST_FILE} says {entry['bytes']}: truncated or overwritten"
    for i, expected in enumerate(entry[algo]):
        chunk = HASHES[algo]()
        chunk.update(data[i * step:(i + 1) * step])
        if chunk.hexdigest() != expected:
            return f"its bytes do not match their {algo} in {MANIFEST_FILE}: changed after it was saved"
    return None


def check_bytes(folder: str | os.PathLike, name: str, data: bytes,
                manifest: Optional[dict[str, Any]] = None) -> None:
    """Raise :class:`CheckpointError` naming the file when :func:`_bytes_problem` finds one."""
    problem = _bytes_problem(folder, name, data, manifest)
    if problem:
        raise _corrupt(Path(folder), name, problem)


class _FileVerifier:
    """Hashes every chunk of one shard file on the pool (in file order) and answers, per byte range, once the
    chunks covering it matched the manifest."""

    def __init__(self, folder: Path, name: str, entry: dict[str, Any], chunk_bytes: int,
                 pool: ThreadPoolExecutor, algo: str) -> None:
        self.folder, self.name, self.entry, self.step, self.algo = folder, name, entry, chunk_bytes, algo
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size != entry["bytes"]:
            raise _size_error(folder, name, size, entry["bytes"])
        self._fd = os.open(path, os.O_RDONLY)
        starts = range(0, size, chunk_bytes) if size else [0]
        if len(starts) != len(entry[algo]):
            os.close(self._fd)
            raise _corrupt(folder, name, f"{MANIFEST_FILE} lists {len(entry[algo])} chunks for it, its size needs"
                                         f" {len(starts)}")
        self._futures = [pool.submit(_digest, self._fd, s, min(chunk_bytes, size - s), algo) for s in starts]
        self._checked: set[int] = set()

    def check_range(self, offset: int, length: int) -> None:
        last = max(offset, offset + length - 1) // self.step
        for i in range(offset // self.step, min(last, len(self._futures) - 1) + 1):
            if i not in self._checked:
                if self._futures[i].result() != self.entry[self.algo][i]:
                    raise _mismatch(self.folder, self.name, i, self.step, self.entry["bytes"], self.algo)
                self._checked.add(i)

    def check_all(self) -> None:
        self.check_range(0, self.entry["bytes"])

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            if not future.cancelled():
                future.exception()
        os.close(self._fd)


# DCP's .metadata holds only these (checked against what torch 2.14 writes for plain tensors, DTensors,
# ShardedTensors and non-tensor items); anything else in it was put there by hand.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as the pickles of early Python 3.11 releases call it for an enum member (DCP's
    ``_MEM_FORMAT_ENCODING``: 3.11.2, Debian 12's, writes them so; 3.11.7 calls the class with the value),
    for a member of an admitted enum only: getattr itself would reach any method of an admitted class."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"builtins.getattr of {getattr(cls, '__name__', type(cls).__name__)}.{name}")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {pid!r}")


def load_metadata(folder: str | os.PathLike, name: str = METADATA_FILE,
                  manifest: Optional[dict[str, Any]] = None) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, checked against the manifest first and unpickled admitting only DCP's
    metadata classes: a crafted file fails with one line instead of running its payload."""
    folder = Path(folder)
    path = folder / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(folder)!r} is incomplete or not a disttrain checkpoint: missing"
                              f" {name}; {FIX}") from None
    check_bytes(folder, name, data, manifest)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {name} holds {e}, which DCP metadata never contains; it"
                              " was not loaded (the file was crafted or is not DCP's); load only checkpoints you"
                              " trust") from None
    except Exception as e:  # truncated or garbled pickles fail in many ways
        raise CheckpointError(f"checkpoint {str(folder)!r} is corrupt: cannot read {name} ({type(e).__name__}:"
                              f" {e}); {FIX}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {str(folder)!r} is corrupt: {name} holds a {type(metadata).__name__},"
                              f" not DCP metadata; {FIX}")
    return metadata


class _CheckedBytes:
    """The load planner, except that a non-tensor item reaches it (DCP's planners unpickle those with
    weights_only=False) only after ``torch.load(weights_only=True)`` accepted it."""

    def __init__(self, planner: Any, folder: Path) -> None:
        self._planner, self._folder = planner, folder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getbuffer()), weights_only=True)
        except Exception as e:
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = refused.group(1) if refused else f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            raise CheckpointError(
                f"checkpoint {str(self._folder)!r}: item {read_item.storage_index.fqn!r} holds an object that safe"
                f" loading refuses ({what}); it was not loaded; if you trust this checkpoint load it with"
                " weights_only=False") from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


class CheckpointReader(FileSystemReader):
    """``dcp.load(state, storage_reader=CheckpointReader(folder))``: DCP's FileSystemReader made safe for folders
    you did not write. ``.metadata`` is checked against ``manifest.json`` and unpickled admitting only DCP's
    metadata classes; every shard file this process reads from is hashed (chunks on a thread pool, ahead of the
    reads) and no item is deserialized from a chunk before it matched; non-tensor items must pass
    ``torch.load(weights_only=True)`` unless ``weights_only=False``. A mismatch raises :class:`CheckpointError`
    naming the file (a load that fails part-way leaves its targets partly overwritten: do not train on them).
    A folder without a manifest (written before checksums, or by another library: ``written_by`` names it) is read
    unverified, with one warning.

    The manifest and ``.metadata`` are read when the reader is made, so a bad folder fails right there with one
    line (inside ``dcp.load`` DCP would print tracebacks and try per-rank metadata files first)."""

    def __init__(self, path: str | os.PathLike, weights_only: bool = True, written_by: Optional[str] = None) -> None:
        super().__init__(path)
        self.weights_only = weights_only
        self.folder = Path(path)
        self.manifest = read_manifest(self.folder)
        if self.manifest is None:
            warn_unverified(self.folder, written_by)
        self.metadata = load_metadata(self.folder, METADATA_FILE, self.manifest)
        self._verifiers: dict[str, _FileVerifier] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = self.metadata if rank is None else \
            load_metadata(self.folder, f"__{rank}{METADATA_FILE}", self.manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        planner = _CheckedBytes(planner, self.folder) if self.weights_only else planner
        if self.manifest is None or not files:
            return super().read_data(plan, planner)
        pool = ThreadPoolExecutor(_hash_threads(), thread_name_prefix="disttrain-verify")
        try:
            step = int(self.manifest["chunk_bytes"])
            for name in files:
                self._verifiers[name] = _FileVerifier(self.folder, name, _entry(self.folder, self.manifest, name),
                                                      step, pool, self.manifest["hash"])
            future = super().read_data(plan, planner)
            for verifier in self._verifiers.values():
                verifier.check_all()  # also the parts this rank did not need: the whole file is sound
            return future
        finally:
            for verifier in self._verifiers.values():
                verifier.close()
            self._verifiers = {}
            pool.shutdown(wait=True, cancel_futures=True)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        # FileSystemReader asks for every item's byte range here just before deserializing it: the one place to
        # hold a read until the chunks under it are verified (should a torch version stop calling it, read_data's
        # check_all still verifies every file before the load returns).
        verifier = self._verifiers.get(sinfo.relative_path)
        if verifier is not None:
            verifier.check_range(sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)


def unwrap_dcp_error(error: BaseException) -> Optional[CheckpointError]:
    """The :class:`CheckpointError` a reader raised inside ``dcp.load`` (DCP wraps every rank's failure in one
    CheckpointException), so callers can show its one line instead of DCP's per-rank tracebacks."""
    if isinstance(error, CheckpointError):
        return error
    for failure in getattr(error, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
    return None


# -- offline verification --------------------------------------------------------------------------------------
def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """Every problem of a DCP checkpoint folder, one line each naming the file (empty: it verifies). Reads every
    byte once; one process, no collective. A folder without a manifest is checked for structure only."""
    folder = Path(path)
    if not folder.exists():
        return [f"{folder}: does not exist"]
    if not folder.is_dir():
        return [f"{folder}: is a single file, not a checkpoint folder (only sharded checkpoint folders carry"
                " checksums)"]
    problems: list[str] = []
    try:
        manifest = read_manifest(folder)
    except CheckpointError as e:
        return [str(e)]
    sizes: dict[str, int] = {}
    reported: set[str] = set()  # one line per file
    if manifest is not None:
        step, algo = int(manifest["chunk_bytes"]), manifest["hash"]
        for name, entry in manifest["files"].items():
            file = folder / name
            if not file.is_file():
                problems.append(str(_size_error(folder, name, None, entry.get("bytes", -1))))
                reported.add(name)
                continue
            actual = hash_file(file, step, algo)
            sizes[name] = actual["bytes"]
            if actual["bytes"] != entry.get("bytes"):
                problems.append(str(_size_error(folder, name, actual["bytes"], entry.get("bytes", -1))))
                reported.add(name)
                continue
            bad = [i for i, (a, b) in enumerate(zip(actual[algo], entry.get(algo, []))) if a != b]
            if bad or len(actual[algo]) != len(entry.get(algo, [])):
                problems.append(str(_mismatch(folder, name, bad[0] if bad else 0, step, actual["bytes"], algo)))
                reported.add(name)
    try:
        metadata = load_metadata(folder, manifest=manifest)
    except CheckpointError as e:
        if METADATA_FILE not in reported:
            problems.append(str(e))
        return problems
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if name in reported:
            continue
        if manifest is not None and name not in manifest["files"]:
            problems.append(str(_corrupt(folder, name, f"it holds tensors but is not listed in {MANIFEST_FILE}")))
        elif not file.is_file():
            if manifest is None:
                problems.append(f"checkpoint {str(folder)!r} is incomplete: {name} is missing; {FIX}")
        elif sizes.get(name, file.stat().st_size) < end:
            problems.append(str(_corrupt(folder, name, f"it has {file.stat().st_size} bytes, its tensors need {end}:"
                                                       " truncated")))
    return problems


def verify_checkpoint(path: str | os.PathLike) -> Path:
    """Check every file of a DCP checkpoint folder against its manifest (and DCP's metadata against the files);
    raise :class:`CheckpointError` with one line naming the first bad file, or return the path. One process, no
    collective: call it on the rank(s) that should pay for reading the whole folder. Loads through
    :class:`CheckpointReader` already verify the files they read."""
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError(problems[0])
    return Path(path)
