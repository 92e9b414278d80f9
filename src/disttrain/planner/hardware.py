"""The machine the planner plans for: device memory, peak FLOP/s, link bandwidths, host memory."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import sys

import torch

from disttrain.planner.spec import parse_bytes

GiB = 2**30


@dataclass(frozen=True)
class Overheads:
    """Seconds of framework work per step that is neither compute nor traffic (Python, operator dispatch, the
    engines' hooks), which dominates small models: per transformer block's forward and backward ``eager`` (plain
    module), ``sharded`` (under FSDP2's gather/reduce hooks; ZeRO-3 counted the same) and ``tensor_parallel`` (under
    DTensor plans); ``microbatch``: a pipeline schedule's work for one microbatch on one stage beyond its blocks.
    ``overlaps``: the device computes while the host dispatches (GPUs: a step takes the longer of the two; CPU
    processes do both in turn: their sum). ``optimizer_tensor`` / ``optimizer_dtensor``: the optimizer step's
    and ``zero_grad``'s seconds per parameter tensor, plain or a DTensor (FSDP2's shards, tensor-parallel weights),
    whatever its size: torch's AdamW loops over the tensors on a CPU, and every op on a DTensor goes through its
    dispatch, which outweighs a small model's optimizer bytes. ``collective``: what a collective on the critical
    path (tensor-parallel all-reduces, pipeline sends, context- and expert-parallel all-to-alls; FSDP's gathers and
    reduce-scatters where there are no streams to prefetch on) costs beyond its link's latency and bytes when it sits
    between computations, as there: the ranks arrive apart and, on CPU
    processes, gloo's threads wake up and compete with the compute for the cores."""

    eager: float
    sharded: float
    tensor_parallel: float
    microbatch: float
    overlaps: bool = True
    optimizer_tensor: float = 0.0
    optimizer_dtensor: float = 0.0
    collective: float = 0.0
    zero3: float = 0.0


# A GPU's kernel launches (~5 us each, ~30 per block forward and backward), its hooks' and DTensor's Python; a CPU's
# as measured on a 2-core host with gloo. `disttrain calibrate` measures them (planner/calibrate.py).
# On GPUs torch's AdamW runs foreach kernels over lists of tensors (DTensors dispatch once per list), a few us a tensor.
GPU_OVERHEADS = Overheads(eager=1.5e-4, sharded=3e-4, tensor_parallel=6e-4, microbatch=1e-3,
                          optimizer_tensor=2e-6, optimizer_dtensor=4e-6, zero3=1e-3)
CPU_OVERHEADS = Overheads(eager=5e-4, sharded=2.5e-3, tensor_parallel=5e-3, microbatch=2.5e-3, overlaps=False,
                          optimizer_tensor=4e-5, optimizer_dtensor=2.7e-4, collective=8e-4, zero3=1e-2)


@dataclass(frozen=True)
class Hardware:
    """One kind of device and its links. Bandwidths are bytes/s that one device achieves in a collective:
    ``intra_node_bw`` between devices of a node (NVLink, or PCIe where there is none), ``inter_node_bw`` per device
    across nodes (its share of the node's network). ``pcie_bw`` is host <-> device (offload); ``host_memory`` is
    RAM per node; ``mfu`` the fraction of ``peak_flops`` a training step reaches (for step-time estimates only).
    ``reserved`` is what the runtime takes before any tensor (CUDA context, allocator slack). ``latency`` is the
    seconds one collective costs whatever its size; ``memory_bw`` the device memory's bytes/s (elementwise work),
    ``optimizer_bw`` the bytes of states the optimizer step sweeps per second (default half of ``memory_bw``: read and
    written); ``overlap`` the fraction of data-parallel traffic that can hide behind compute (1: its own engine, as
    NCCL on GPUs); ``overheads`` the framework's own seconds (:class:`Overheads`). ``calibration``: what
    ``disttrain calibrate`` measured here (:mod:`disttrain.planner.calibrate`), used instead of ``peak_flops x mfu``
    and the link figures when present."""

    name: str
    memory: int
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    pcie_bw: float = 12e9
    host_memory: int = 1024 * GiB
    host_optimizer_bw: float = 20e9  # bytes of optimizer state a CPU Adam sweeps per second (offload)
    gpus_per_node: int = 8
    mfu: float = 0.4
    reserved: int = GiB
    latency: float = 20e-6
    memory_bw: float = 1.5e12
    optimizer_bw: float = 0.0
    overlap: float = 1.0
    overheads: Overheads = GPU_OVERHEADS
    calibration: Any = field(default=None, compare=False, repr=False)

    @property
    def optimizer_sweep(self) -> float:
        return self.optimizer_bw or self.memory_bw / 2

    def with_memory(self, memory: str | int) -> Hardware:
        return replace(self, memory=parse_bytes(memory))


# Figures a planner needs to rank, not to predict to the millisecond: NVLink 3 (A100) moves ~300 GB/s per GPU in
# one direction in a ring, NVLink 4 (H100/H200) ~450; a 200 Gb/s HDR NIC per GPU gives ~25 GB/s across nodes. T4 and
# L4 servers have no NVLink: devices talk over PCIe (~12 GB/s per device through the host bridge).
PRESETS: dict[str, Hardware] = {
    "A100-40GB": Hardware("A100-40GB", 40 * GiB, 312e12, 300e9, 25e9, pcie_bw=25e9, memory_bw=1.55e12),
    "A100-80GB": Hardware("A100-80GB", 80 * GiB, 312e12, 300e9, 25e9, pcie_bw=25e9, memory_bw=2.0e12),
    "H100-80GB": Hardware("H100-80GB", 80 * GiB, 989.4e12, 450e9, 50e9, pcie_bw=50e9, memory_bw=3.35e12),
    "H200-141GB": Hardware("H200-141GB", 141 * GiB, 989.4e12, 450e9, 50e9, pcie_bw=50e9, memory_bw=4.8e12),
    "L4-24GB": Hardware("L4-24GB", 24 * GiB, 121e12, 12e9, 6e9, pcie_bw=12e9, memory_bw=0.3e12),
    "T4-16GB": Hardware("T4-16GB", 16 * GiB, 65e12, 10e9, 3e9, pcie_bw=10e9, host_memory=384 * GiB,
                        memory_bw=0.32e12),
    "V100-32GB": Hardware("V100-32GB", 32 * GiB, 125e12, 150e9, 12.5e9, pcie_bw=12e9, memory_bw=0.9e12),
    # A CPU "device" for CI runs: memory is what one process may use; links those of gloo on one host (about a
    # millisecond per collective; its threads share the cores with the compute, so half of it overlaps). Run
    # `disttrain calibrate` to measure them instead.
    "cpu": Hardware("cpu", 8 * GiB, 1e11, 5e9, 1e9, pcie_bw=1e12, gpus_per_node=1024, reserved=0, latency=1e-3,
                    memory_bw=10e9, overlap=0.5, overheads=CPU_OVERHEADS),
}


def hardware(name: str | None = None, memory: str | int | None = None, **overrides: float) -> Hardware:
    """A preset by name ("A100-40GB", "a100", "T4", ...), with ``memory=`` ("40GiB") and any field overridden.
    Without a name: an A100-class node (NVLink, 25 GB/s per GPU between nodes) with the memory given."""
    base = _preset(name) if name else replace(PRESETS["A100-80GB"], name="A100-class GPU")
    if memory is not None:
        base = base.with_memory(memory)
    unknown = set(overrides) - set(Hardware.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown hardware field(s) {sorted(unknown)}; known: {', '.join(Hardware.__dataclass_fields__)}")
    return replace(base, **overrides)


def _preset(name: str) -> Hardware:
    key = name.lower().replace(" ", "-")
    for preset_name, preset in PRESETS.items():
        if preset_name.lower() == key:
            return preset
    matches = [p for n, p in PRESETS.items() if n.lower().startswith(key.split("-")[0])]
    if matches:
        return matches[0]  # "a100" -> A100-40GB; pass memory= for the 80 GB part
    raise ValueError(f"hardware {name!r} is not a preset ({', '.join(PRESETS)}); pass one of those, or memory= and"
                     f" the bandwidths as numbers")


def detect(device: torch.device, world_size: int, gpus_per_node: int | None = None,
           calibrated: bool = True) -> Hardware:
    """The hardware of this process's device: memory and name from CUDA, links from the matching preset, or, when
    ``calibrated`` and ``disttrain calibrate`` has measured this machine at ``world_size`` processes, from its
    cache file (a corrupt one is a CalibrationError naming it): when the world spans nodes of ``gpus_per_node``, the
    one measured over that many nodes, else the one of this host."""
    hw = _detect(device, world_size, gpus_per_node)
    if calibrated:
        from disttrain.planner.calibrate import cached, hardware_from, nodes_of

        calibration = cached(device, world_size, nodes_of(world_size, gpus_per_node))
        if calibration is not None:
            return hardware_from(calibration, hw)
    return hw


def _detect(device: torch.device, world_size: int, gpus_per_node: int | None) -> Hardware:
    if device.type != "cuda":
        import psutil

        # On CPU the ranks share the host's memory: each gets its share of the total (not of what is free now, which
        # differs between ranks and would let them choose differently). Offloading to the host frees nothing there:
        # no host memory beyond it.
        per_rank = int(psutil.virtual_memory().total / max(1, min(world_size, gpus_per_node or world_size)))
        return replace(PRESETS["cpu"], memory=per_rank, gpus_per_node=gpus_per_node or world_size, host_memory=0)
    props = torch.cuda.get_device_properties(device)
    name = props.name
    base = PRESETS["A100-80GB"]
    for preset_name, preset in PRESETS.items():
        if preset_name.split("-")[0].lower() in name.lower():
            base = preset
            break
    return replace(base, name=name, memory=props.total_memory,
                   gpus_per_node=gpus_per_node or torch.cuda.device_count())


def present(kind: str, world_size: int, memory: Any = None, measure: bool = True, **overrides: Any) -> Any:
    """The Hardware of ``world_size`` processes on this machine's ``kind`` ("cpu" or "cuda") devices, with this
    machine's calibration: the cached one (over the nodes ``gpus_per_node=`` makes of the world, when measured so
    by ``disttrain calibrate --num-nodes``), else (``measure``) measured now on this host and cached (said on
    stderr): ``world_size`` processes, or one node's when this machine has fewer GPUs than the world (a cluster of
    nodes like this one)."""
    from disttrain.planner.calibrate import cache_path, cached, calibrate, hardware_from, nodes_of

    device = torch.device(kind)
    hw = detect(device, world_size, calibrated=False)
    if memory is not None:
        hw = hw.with_memory(memory)
    if overrides:
        hw = replace(hw, **overrides)
    calibration = cached(device, world_size, nodes_of(world_size, hw.gpus_per_node))
    here = world_size if kind == "cpu" or world_size <= torch.cuda.device_count() else hw.gpus_per_node
    if calibration is None and here != world_size:
        calibration = cached(device, here)
    if calibration is None and measure:
        print(f"calibrating {here} {kind} processes (once; cached in {cache_path(device, here)})",
              file=sys.stderr, flush=True)
        calibration = calibrate(here, kind)
    return hardware_from(calibration, hw) if calibration is not None else hw
