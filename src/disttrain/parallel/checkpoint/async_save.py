"""Asynchronous checkpoints (``async_checkpoint=True``): training goes on while the previous checkpoint is written.

A save copies this rank's tensors to host memory (``torch.distributed.checkpoint.async_save`` with DCP's
``DefaultStager``: one copy per storage, buffers kept from one save to the next, pinned on CUDA) and returns; DCP
writes the shards from that copy in a background thread. A second background thread then finishes the folder as
a synchronous save does (``checkpoint.finish_folder``: ``meta.pt``, the manifest with every file's checksum, then the
rename of ``.NAME.tmp`` to ``NAME``), so the folder, manifest and checksums are the same, and a run killed during an
async save leaves the previous checkpoint in place and only a ``.NAME.tmp`` that no reader takes for a checkpoint.

At most one save is in flight: the next save, a load, and the end of the run (``wait``) wait for it, and an error of
the background write (a full disk) is raised there, as the same one line a synchronous save raises.

The background collectives (DCP's planning, the manifest's gather, the barriers around the rename) run over a gloo
group of their own: on the default group they would interleave with the training's collectives in another order on
each rank. torchtitan's async mode does the same.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from disttrain.parallel.checkpoint.integrity import ChecksumWriter
from disttrain.parallel.checkpoint.io import KEPT, abandon_folder, begin_folder, commit_folder, finish_folder
from disttrain.parallel.guards.diskspace import writing
from disttrain.parallel.guards.watchdog import phase

# TEST ONLY: "N": the N-th async save of this process stops after its shards are written, before meta.pt, the
# manifest and the rename (:data:`held` is set, then the writer sleeps), so that a test can kill the run while the
# save is in flight and check that the previous checkpoint is the one a resume finds.
HOLD_ENV = "DISTTRAIN_HOLD_ASYNC_SAVE"
held = threading.Event()  # TEST ONLY: set when a save stops at HOLD_ENV's point


def stager_closed_itself(stager: DefaultStager) -> bool:
    """Whether ``stager`` closed itself after staging, as DefaultStager does in some torch releases (2.11 among
    them): that clears its copier's dispatch table, and its next stage of a state holding a class object (a DTensor's
    mesh and placements do) fails with ``KeyError: <class 'type'>``. Such a stager kept no buffers anyway."""
    copier = getattr(stager, "_state_dict_stager", None)
    return copier is not None and not getattr(copier, "_deepcopy_dispatch", True)


class AsyncSaver:
    """One per engine: writes the checkpoint folders of ``checkpoint.save_sharded(..., saver=self)`` in the
    background, one at a time. Collective like a synchronous save: every rank calls :meth:`save` and :meth:`wait`
    in the same order."""

    def __init__(self) -> None:
        self._group: Any = None
        self._stager: Optional[DefaultStager] = None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disttrain-checkpoint")
        self._pending: Optional[Future] = None
        self._path: Optional[Path] = None  # the folder of the save in flight
        self._saves = 0

    def writes(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is the folder of the save in flight (to remove or read it, :meth:`wait` first)."""
        return self._pending is not None and self._path == Path(path)

    def save(self, path: str | os.PathLike, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Collective: stage ``tensors`` (the caller may change them as soon as this returns) and write them, with
        ``meta`` as ``meta.pt``, into the folder ``path`` in the background. Call :meth:`wait` first (save_sharded
        does)."""
        self.wait()
        # meta.pt is written in the background too: from a copy taken now, as training changes the loop state it holds.
        meta = copy.deepcopy(meta)
        distributed = dist.is_available() and dist.is_initialized()
        if self._group is None and distributed:
            self._group = dist.new_group(backend="gloo")  # collective: every rank's first save creates it
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        self._saves += 1
        hold = os.environ.get(HOLD_ENV) == str(self._saves)
        with phase(f"staging checkpoint {path}"):
            tmp = begin_folder(path)
            writer = ChecksumWriter(tmp)  # each rank hashes the shard it writes, while writing it
            try:
                with writing(path, "the checkpoint's shards", kept=KEPT):
                    written = dcp.async_save(tensors, storage_writer=writer, async_stager=self._stager,
                                             process_group=self._group, no_dist=not distributed)
            except BaseException:
                abandon_folder(tmp)
                raise
        if stager_closed_itself(self._stager):
            self._stager = None  # the next save stages with a new one
        self._pending = self._finisher.submit(self._finish, written, Path(path), tmp, writer, meta, hold)
        self._path = Path(path)
        return Path(path)

    def _finish(self, written: Future, path: Path, tmp: Path, writer: ChecksumWriter, meta: dict[str, Any],
                hold: bool) -> None:
        """In the background: wait for DCP's shards, then finish and swap in the folder as a synchronous save
        does (over the saver's own group)."""
        try:
            with writing(path, "the checkpoint's shards", kept=KEPT):
                written.result()
            if hold:
                print(f"async save of {path} held before its manifest ({HOLD_ENV}, test only)", flush=True)
                held.set()
                while True:
                    time.sleep(3600)
            finish_folder(tmp, meta, writer.digests, self._group)
        except BaseException:
            abandon_folder(tmp)
            raise
        commit_folder(tmp, path, self._group)

    def wait(self) -> None:
        """Block until the save in flight is complete; its error is raised here (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then free the staging buffers (a later save stages anew)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
