"""The machine the planner plans for: device memory, peak FLOP/s, link bandwidths, host memory."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from disttrain.planner.spec import parse_bytes

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One kind of device and its links. Bandwidths are bytes/s that one device achieves in a collective:
    ``intra_node_bw`` between devices of a node (NVLink, or PCIe where there is none), ``inter_node_bw`` per device
    across nodes (its share of the node's network). ``pcie_bw`` is host <-> device (offload); ``host_memory`` is
    RAM per node; ``mfu`` the fraction of ``peak_flops`` a training step reaches (for step-time estimates only).
    ``reserved`` is what the runtime takes before any tensor (CUDA context, allocator slack)."""

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

    def with_memory(self, memory: str | int) -> Hardware:
        return replace(self, memory=parse_bytes(memory))


# Figures a planner needs to rank, not to predict to the millisecond: NVLink 3 (A100) moves ~300 GB/s per GPU in
# one direction in a ring, NVLink 4 (H100/H200) ~450; a 200 Gb/s HDR NIC per GPU gives ~25 GB/s across nodes. T4 and
# L4 servers have no NVLink: devices talk over PCIe (~12 GB/s per device through the host bridge).
PRESETS: dict[str, Hardware] = {
    "A100-40GB": Hardware("A100-40GB", 40 * GiB, 312e12, 300e9, 25e9, pcie_bw=25e9),
    "A100-80GB": Hardware("A100-80GB", 80 * GiB, 312e12, 300e9, 25e9, pcie_bw=25e9),
    "H100-80GB": Hardware("H100-80GB", 80 * GiB, 989.4e12, 450e9, 50e9, pcie_bw=50e9),
    "H200-141GB": Hardware("H200-141GB", 141 * GiB, 989.4e12, 450e9, 50e9, pcie_bw=50e9),
    "L4-24GB": Hardware("L4-24GB", 24 * GiB, 121e12, 12e9, 6e9, pcie_bw=12e9),
    "T4-16GB": Hardware("T4-16GB", 16 * GiB, 65e12, 10e9, 3e9, pcie_bw=10e9, host_memory=384 * GiB),
    "V100-32GB": Hardware("V100-32GB", 32 * GiB, 125e12, 150e9, 12.5e9, pcie_bw=12e9),
    # A CPU "device" for CI runs: memory is what one process may use; bandwidth that of gloo on one host.
    "cpu": Hardware("cpu", 8 * GiB, 1e11, 5e9, 1e9, pcie_bw=1e12, gpus_per_node=1024, reserved=0),
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


def detect(device: torch.device, world_size: int, gpus_per_node: int | None = None) -> Hardware:
    """The hardware of this process's device: memory and name from CUDA, links from the matching preset."""
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
