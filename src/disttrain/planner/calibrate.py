"""The machine the planner plans for, measured: matmul throughput at the model's shapes, memory and optimizer sweep
bandwidth, the latency and bandwidth of each collective over the real process group, and the framework's own
seconds per block (plain, sharded, tensor-parallel, pipelined), cached per machine.

    disttrain calibrate --devices 2                 # gloo on CPU, nccl on GPUs; writes the cache file it names
    disttrain calibrate --devices 8 --model configs/nlp/dialogue_1b.yaml   # also the model's own matmul shapes
    disttrain calibrate --devices 8 --num-nodes 2 --node-rank R --main-address NODE0   # on each node: both links

A calibration is one JSON file per (host, device, world size) under :func:`cache_dir` (``$DISTTRAIN_CACHE`` or
``$XDG_CACHE_HOME/disttrain``, by default ``~/.cache/disttrain``), in ``calibration/``; one over several nodes is a
file of its own (``HOST-DEVICE-NODESxPER_NODE.json``) on every node. The planner uses it whenever it plans for the
hardware present (``disttrain plan`` without ``--gpu``, ``disttrain_auto`` without ``hardware=``); a preset (``--gpu
A100``) stands for hardware that is not here.

Over several nodes the collectives are measured twice: within a node (``links``: every node's ranks as one group) and
between nodes (``inter_links``: the ranks of one local rank on every node, as HSDP's replicas), and the planner
charges traffic that crosses nodes with the second. A calibration of one node has no ``inter_links``: traffic across
nodes is then charged at the preset's ``inter_node_bw`` and ``latency`` (``disttrain plan --inter-node-gbps``), as
for hardware that is not here.

Each collective is timed at several sizes and fitted to ``time = latency + bytes / bandwidth`` (the alpha-beta
model), where ``bytes`` is what one rank sends in the usual ring algorithm: ``(n-1)/n`` of the gathered tensor for
all-gather, reduce-scatter and all-to-all, twice that for all-reduce; the planner's traffic figures count bytes the
same way. ``overlap`` is the fraction of a collective that hides behind a matmul running at the same time (about 1
on GPUs, where NCCL has its own stream; on CPU gloo's threads compete with the compute for the cores).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
OVERHEADS = {"eager", "sharded", "tensor_parallel", "microbatch"}  # the measured fields of hardware.Overheads
# measured since; older files: the preset's
LATER_OVERHEADS = {"optimizer_tensor", "optimizer_dtensor", "collective", "zero3"}
MODEL_ROW = {"key", "name", "micro_batch", "seq_len", "depths", "seconds"}  # a row of Calibration.models
VERSION = 1  # of the file's layout: a file of another version is measured again, not misread


class CalibrationError(ValueError):
    """A calibration cache file that cannot be read (the message names the file and the fix)."""


@dataclass(frozen=True)
class Link:
    """One collective on this machine's process group: seconds per call and bytes per second one rank sends."""

    latency: float
    bandwidth: float

    def time(self, sent_bytes: float, calls: float = 1.0) -> float:
        return calls * self.latency + sent_bytes / self.bandwidth


@dataclass
class Calibration:
    """What ``disttrain calibrate`` measured on one machine (see the module docstring)."""

    host: str
    device: str
    world_size: int
    backend: str
    matmul: list[list[float]]  # [m, n, k, FLOP/s] per shape measured, fp32 on CPU, bf16 on GPUs
    memory_bw: float  # bytes/s a large elementwise op reads and writes
    optimizer_bw: float  # bytes of parameters + gradients + AdamW state that torch's AdamW sweeps per second
    links: dict[str, Link]  # within a node
    overlap: float
    overheads: Optional[dict[str, float]] = None  # Overheads' seconds; None in older files: the preset's figures
    blocks: Optional[list[list[float]]] = None  # [tokens, hidden, efficiency] per size measured (measure_blocks)
    models: Optional[list[dict]] = None  # the models' own forward + backward, timed (measure_models)
    measured_at: str = ""
    torch_version: str = ""
    # Over several nodes: the collectives between them (over one rank per node, see measure_node_links) and how many
    # nodes; None and 1 in files of one node, older files among them (crossing traffic: the preset's figures).
    inter_links: Optional[dict[str, Link]] = None
    nodes: int = 1
    version: int = VERSION
    path: str = ""

    def matmul_flops(self, m: float, n: float, k: float) -> float:
        """FLOP/s of the measured shape nearest to ``m x n x k`` (by size, on a log scale)."""
        if not self.matmul:
            raise CalibrationError(f"calibration {self.path} holds no matmul shapes: run `disttrain calibrate` again")
        size = math.log(max(1.0, m * n * k))
        return min(self.matmul, key=lambda row: abs(math.log(max(1.0, row[0] * row[1] * row[2])) - size))[3]

    def block_efficiency(self, tokens: float, hidden: float) -> float:
        """The fraction of the matmul throughput a transformer block's training reaches at the measured size nearest
        to ``tokens`` x ``hidden`` (1 in files without block measurements)."""
        if not self.blocks:
            return 1.0
        size = math.log(max(1.0, tokens * hidden * hidden))
        return min(self.blocks, key=lambda row: abs(math.log(max(1.0, row[0] * row[1] * row[1])) - size))[2]

    def model_profile(self, spec: Any) -> Optional[dict]:
        """The timing of ``spec``'s own model (:func:`measure_models`: a model of the same blocks at any depth),
        None when it was not measured."""
        key = model_key(spec)
        rows = [row for row in self.models or [] if row["key"] == key]
        return rows[-1] if rows else None

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("path")
        out["links"] = {op: asdict(link) for op, link in self.links.items()}
        if self.inter_links is None:
            out.pop("inter_links")  # a file of one node as it always was
        else:
            out["inter_links"] = {op: asdict(link) for op, link in self.inter_links.items()}
        return out

    @property
    def per_node(self) -> int:
        """Processes per node in the calibration."""
        return self.world_size // self.nodes


def cache_dir() -> Path:
    """Where calibrations are kept: ``$DISTTRAIN_CACHE``, else ``$XDG_CACHE_HOME/disttrain``, else
    ``~/.cache/disttrain``."""
    if os.environ.get("DISTTRAIN_CACHE"):
        return Path(os.environ["DISTTRAIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "disttrain"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return "cpu"


def cache_path(device: torch.device | str, world_size: int, host: Optional[str] = None, nodes: int = 1) -> Path:
    """The cache file of ``world_size`` processes on ``device``'s kind on this host (``HOST-DEVICE-N.json``); over
    ``nodes`` > 1 nodes, the file of that layout (``HOST-DEVICE-NODESxPER_NODE.json``): a calibration whose ranks
    spanned nodes does not stand for one whose ranks shared a host."""
    device = torch.device(device) if isinstance(device, str) else device
    count = f"{nodes}x{world_size // nodes}" if nodes > 1 else f"{world_size}"
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{host or socket.gethostname()}-"
                   f"{device_name(device)}-{count}")
    return cache_dir() / "calibration" / f"{name}.json"


def _links(table: Any) -> dict[str, Link]:
    links = {op: Link(**table[op]) for op in OPS}
    for op, link in links.items():
        if not (0 <= link.latency < math.inf and 0 < link.bandwidth < math.inf):
            raise ValueError(f"{op} link {link} is not a finite latency >= 0 and bandwidth > 0")
    return links


def load(path: str | os.PathLike) -> Optional[Calibration]:
    """The calibration in ``path``, None when there is none; a file that cannot be read is one CalibrationError
    naming it and the fix."""
    path = Path(path)
    if not path.exists():
        return None
    fix = "delete it or run `disttrain calibrate --force` to measure again"
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            raise CalibrationError(f"calibration cache {path} was written by another disttrain version "
                                   f"({data.get('version')!r}, this one reads {VERSION}): {fix}")
        data["links"] = _links(data["links"])
        if data.get("inter_links") is not None:
            data["inter_links"] = _links(data["inter_links"])
        nodes = data.get("nodes", 1)
        if not (isinstance(nodes, int) and nodes >= 1 and data["world_size"] % nodes == 0):
            raise ValueError(f"nodes {nodes!r} does not divide world_size {data['world_size']!r}")
        if (nodes > 1) != (data.get("inter_links") is not None):
            raise ValueError(f"{nodes} node(s) with{'out' if nodes > 1 else ''} inter-node links")
        overheads = data.get("overheads")
        if overheads is not None and not OVERHEADS <= set(overheads) <= OVERHEADS | LATER_OVERHEADS:
            raise ValueError(f"overheads {sorted(overheads)} are not {sorted(OVERHEADS)}"
                             f" (and optionally {sorted(LATER_OVERHEADS)})")
        if any(len(row) != 3 or not 0 < row[2] <= 1 for row in data.get("blocks") or []):
            raise ValueError(f"blocks {data['blocks']} are not [tokens, hidden, efficiency in (0, 1]] rows")
        for row in data.get("models") or []:
            if set(row) != MODEL_ROW or len(row["depths"]) != len(row["seconds"]) or \
                    not all(t > 0 and math.isfinite(t) for t in row["seconds"]):
                raise ValueError(f"model timing {row} does not have {sorted(MODEL_ROW)} with positive seconds")
        return Calibration(**data, path=str(path))
    except CalibrationError:
        raise
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CalibrationError(f"calibration cache {path} is unreadable ({type(e).__name__}: {e}): {fix}") from None


def save(calibration: Calibration, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.to_json(), indent=1))
    os.replace(tmp, path)  # readers never see half a file
    calibration.path = str(path)
    return path


# -- measuring (in every process of the group) ------------------------------------------------------------------
LOCAL_SAMPLE = 0.02  # seconds: a sample of work local to a rank lasts at least this (calls looped), see _timed


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int, sync: Callable[[], None],
           fastest: bool = False, min_seconds: float = 0.0, start: Optional[Callable[[], None]] = None) -> float:
    """Median (``fastest``: least) seconds of one call of ``fn`` over ``repeats`` samples after one warm-up call.
    ``min_seconds``: each sample loops as many calls as its warm-up says last that long (a sub-millisecond call
    timed alone is mostly the timer's and the scheduler's noise: single matmuls of one shape measured 112-171
    GFLOP/s on a 2-core machine, looped ones 150-160). Only for work local to the rank: ranks would loop different
    counts of a collective. ``start``: what each sample starts with instead of ``sync`` (which still ends it)."""
    start = start or sync
    start()
    t0 = time.perf_counter()
    fn()
    sync()
    calls = max(1, min(1000, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-9)))) if min_seconds else 1
    times = []
    for _ in range(repeats):
        start()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return min(times) if fastest else statistics.median(times)


def _device_sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _barrier_sync(device: torch.device, group: Any = None) -> Callable[[], None]:
    """The device's work done, then every rank of ``group`` here: what a sample of a collective starts and ends
    with, so that no rank's timing includes waiting for a late one."""
    import torch.distributed as dist

    sync = _device_sync(device)

    def barrier_sync() -> None:
        sync()
        dist.barrier(group)

    return barrier_sync


def measure_matmul(shapes: Iterable[tuple[int, int, int]], device: torch.device, repeats: int = 5
                   ) -> list[list[float]]:
    """FLOP/s of ``(m, k) @ (k, n)`` per shape (fp32 on CPU, bf16 on GPUs: the dtypes training computes in)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = _device_sync(device)
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = _timed(lambda: a @ b, device, repeats, sync, min_seconds=LOCAL_SAMPLE)
        out.append([m, n, k, 2.0 * m * n * k / seconds])
    return out


def measure_memory(device: torch.device, elements: int, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s of ``c = a + b`` on ``elements`` fp32 values, bytes/s of parameters + gradients + AdamW state that
    one AdamW step sweeps): elementwise work and the optimizer step are bound by memory, not FLOPs."""
    sync = _device_sync(device)
    a, b = torch.randn(elements, device=device), torch.randn(elements, device=device)
    c = torch.empty_like(a)
    add = _timed(lambda: torch.add(a, b, out=c), device, repeats, sync, min_seconds=LOCAL_SAMPLE)
    param = torch.nn.Parameter(torch.randn(elements, device=device))
    param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW([param], lr=1e-6)
    step = _timed(opt.step, device, repeats, sync, min_seconds=LOCAL_SAMPLE)
    return 3 * 4 * elements / add, 4 * 4 * elements / step  # read a, b, write c; param, grad, two moments


def measure_link(op: str, sizes: Iterable[int], device: torch.device, group: Any = None, repeats: int = 5) -> Link:
    """``op`` over ``group`` (default: the whole process group) at each total size (bytes of the gathered / reduced
    tensor), fitted to latency + sent / bandwidth by least squares (sent: what one rank sends, see the module
    docstring)."""
    return _fit(link_points(op, sizes, device, group, repeats))


def link_points(op: str, sizes: Iterable[int], device: torch.device, group: Any = None, repeats: int = 5,
                start_group: Any = None) -> list[tuple[float, float]]:
    """(bytes one rank sends, seconds) of ``op`` over ``group`` at each total size (:func:`measure_link`). Each
    sample starts with a barrier over ``start_group`` (default: ``group``) and ends with one over ``group``."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    barrier_sync = _barrier_sync(device, group)
    start = None if start_group is None else _barrier_sync(device, start_group)
    points = []
    for size in sizes:
        elements = max(n, size // 4 // n * n)
        full = torch.randn(elements, device=device)
        part = torch.empty(elements // n, device=device)
        if op == "all_gather":
            fn = lambda: dist.all_gather_into_tensor(full, part, group=group)  # noqa: E731
            sent = (n - 1) / n * elements * 4
        elif op == "reduce_scatter":
            fn = lambda: dist.reduce_scatter_tensor(part, full, group=group)  # noqa: E731
            sent = (n - 1) / n * elements * 4
        elif op == "all_reduce":
            fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
            sent = 2 * (n - 1) / n * elements * 4
        elif op == "all_to_all":
            out = torch.empty_like(full)
            fn = lambda: dist.all_to_all_single(out, full, group=group)  # noqa: E731
            sent = (n - 1) / n * elements * 4
        else:
            raise ValueError(f"collective {op!r} is not measured; choose one of {', '.join(OPS)}")
        points.append((sent, _timed(fn, device, repeats, barrier_sync, start=start)))
    return points


def node_ranks() -> list[list[int]]:
    """The ranks of each node of the process group, in node order: each rank's node is torchrun's ``GROUP_RANK``
    (the ``--node-rank`` its launch was given), gathered from every rank. Call it on every rank."""
    import torch.distributed as dist

    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, int(os.environ.get("GROUP_RANK", "0")))
    ranks = [[r for r, node in enumerate(found) if node == n] for n in sorted(set(found))]
    if len({len(r) for r in ranks}) > 1:
        raise ValueError(f"the nodes run {[len(r) for r in ranks]} processes: launch every node with the same"
                         " --devices")
    return ranks


def measure_node_links(nodes: list[list[int]], sizes: Iterable[int], device: torch.device, repeats: int = 5
                       ) -> tuple[dict[str, Link], dict[str, Link]]:
    """(links within a node, links between nodes) of each collective over ``nodes`` (:func:`node_ranks`). Within: each
    node's ranks as one group, every node's group at once. Between: the ranks of one local rank on every node as one
    group, every local rank's group at once. That is the group HSDP's replicas all-reduce in (its replicate mesh
    dimension: rank i of every node), and with all of them busy at once each rank gets its share of the node's
    network, the per-device figure ``Hardware.inter_node_bw`` means (a data-parallel collective over every rank
    leaves a node once per ring, its node's link carrying one member's bytes: ``steptime.node_share``). Each point
    is the slowest group's (every rank's times reduced by their maximum), so every rank fits the same links. With one
    process per node there is no link within a node to measure, and the planner never uses one (every group of two
    ranks crosses nodes): the between-node links stand in for them. Call it on every rank."""
    import torch.distributed as dist

    rank, sizes = dist.get_rank(), list(sizes)
    # every rank creates every group, in the same order (torch's rule for new_group)
    within = [dist.new_group(ranks) for ranks in nodes]
    across = [dist.new_group([ranks[i] for ranks in nodes]) for i in range(len(nodes[0]))]
    node = next(n for n, ranks in enumerate(nodes) if rank in ranks)
    groups = {"across": across[nodes[node].index(rank)]}
    if len(nodes[0]) > 1:
        groups["within"] = within[node]
    found: dict[str, dict[str, Link]] = {}
    for kind, group in groups.items():
        # every sample of every group starts together (a barrier of all ranks): the groups compete for the node's
        # link as they do in a step. Started by a barrier of their group alone they drifted apart on a loaded
        # machine, one group's samples running while the other's ranks waited, and measured 2x the link's share.
        # A sample still ends with its group's barrier: its time holds no other group's.
        points = {op: link_points(op, sizes, device, group, repeats, start_group=dist.group.WORLD)
                  for op in OPS}
        times = torch.tensor([[t for _, t in points[op]] for op in OPS], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        found[kind] = {op: _fit([(sent, t) for (sent, _), t in zip(points[op], row)])
                       for op, row in zip(OPS, times.tolist())}
    for group in within + across:
        dist.destroy_process_group(group)
    return found.get("within", found["across"]), found["across"]


def _fit(points: list[tuple[float, float]]) -> Link:
    """Least-squares latency + bytes / bandwidth through (bytes, seconds) points (latency kept >= 0)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:  # noise larger than the size effect: all of it bandwidth at the largest size
        return Link(0.0, xs[-1] / ys[-1])
    latency = my - slope * mx
    if latency < 0:
        slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        latency = 0.0
    return Link(latency, 1.0 / slope)


def measure_overlap(device: torch.device, link_bytes: int, shape: tuple[int, int, int]) -> float:
    """Fraction of an all-reduce hidden behind a matmul issued while it runs (0: none, 1: all), the way FSDP's
    prefetch and DDP's buckets overlap them."""
    import torch.distributed as dist

    m, n, k = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    buf = torch.randn(max(1, link_bytes // 4), device=device)

    def matmuls() -> None:
        for _ in range(4):
            a @ b

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        matmuls()
        work.wait()

    barrier_sync = _barrier_sync(device)
    compute = _timed(matmuls, device, 3, barrier_sync)
    comm = _timed(lambda: dist.all_reduce(buf), device, 3, barrier_sync)
    together = _timed(both, device, 3, barrier_sync)
    hidden = compute + comm - together
    return max(0.0, min(1.0, hidden / min(compute, comm)))


def measure_in_step(device: torch.device, sizes: Iterable[int], calls: int = 20, rounds: int = 3) -> float:
    """Seconds a collective costs beyond its time alone (after a barrier, as the links are measured) when it sits
    between computations, as a tensor-parallel all-reduce or a pipeline send does: ``calls`` x (a few matmuls, then
    an all-reduce of each size), minus the matmuls alone and the all-reduce alone; the median over the sizes and
    ``rounds`` (the three timed side by side each round). On two CPU processes an all-reduce of 64-512 KB between
    2 ms matmuls costs 0.5-0.8 ms more than alone (0.4-0.7 ms)."""
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    side = 512 if device.type == "cpu" else 4096
    a = torch.randn(side // 2, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    sync = _device_sync(device)

    def looped(fn: Callable[[], None]) -> float:
        fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        dist.barrier()
        return (time.perf_counter() - t0) / calls

    barrier_sync = _barrier_sync(device)

    def compute() -> None:
        for _ in range(2):
            a @ b

    extra = []
    for _ in range(rounds):  # the three timings side by side, again and again: the machine's drift cancels
        for size in sizes:
            buf = torch.zeros(size // 4, device=device)

            def between() -> None:
                compute()
                dist.all_reduce(buf)

            alone = _timed(lambda: dist.all_reduce(buf), device, calls, barrier_sync)
            extra.append(looped(between) - looped(compute) - alone)
    found = torch.tensor([max(0.0, statistics.median(extra))], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return float(found.item())


def measure_blocks(sizes: Iterable[tuple[int, int]], device: torch.device, repeats: int = 5) -> list[list[float]]:
    """``[tokens, hidden, efficiency]`` per ``(tokens, hidden)``: a transformer block's forward and backward timed at
    that size against its matmuls alone (forward timed, backward counted as twice that). What a step reaches of the
    matmul throughput once attention, norms, activations and autograd's own work are counted: small widths reach a
    fraction of it, large ones nearly all."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = _device_sync(device)
    out = []
    for tokens, hidden in sizes:
        heads = next(h for h in (max(1, hidden // 64), 1) if hidden % h == 0)
        seq = min(tokens, 128 if device.type == "cpu" else 1024)
        batch = max(1, tokens // seq)
        block = _Block(hidden, heads).to(device, dtype)
        x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
        step = _timed(lambda: block(x).sum().backward(), device, repeats, sync, fastest=True,
                      min_seconds=LOCAL_SAMPLE)
        rows = x.reshape(-1, hidden)
        weights = [layer.weight for layer in (block.qkv, block.proj, block.fc1)]
        wide = torch.randn(batch * seq, 4 * hidden, device=device, dtype=dtype)

        def matmuls() -> None:
            for w in weights:
                rows @ w.t()
            wide @ block.fc2.weight.t()

        forward = _timed(matmuls, device, repeats, sync, fastest=True, min_seconds=LOCAL_SAMPLE)
        out.append([batch * seq, hidden, min(1.0, 3 * forward / step)])
    return out


def model_key(spec: Any) -> str:
    """What identifies a model's blocks and ends whatever its depth: its family, widths and per-block parameters
    (an MoE block's experts among them), and what lies outside the blocks."""
    root = spec.params - spec.layers * spec.layer_params
    return (f"{spec.family} hidden={spec.hidden} ffn={spec.ffn} heads={spec.heads}/{spec.kv_heads} vocab={spec.vocab}"
            f" image={spec.image_size}x{spec.in_chans}->{spec.num_classes} block={spec.layer_params} rest={root}")


def model_depths(layers: int) -> tuple[int, ...]:
    """The depths a model is timed at: one block and up to four (its own depth when that is less), which fit a line
    through the ends' and one block's seconds; a model without repeated blocks as it is."""
    return (1, min(layers, 4)) if layers >= 2 else (max(1, layers),)


def measure_models(models: Iterable[dict], device: torch.device, repeats: int = 5) -> list[dict]:
    """Each model's own forward, loss and backward (no engine, no optimizer), timed in every process at once (as the
    data-parallel ranks of a step compete for the machine) at its micro-batch and sequence and at the depths of
    :func:`model_depths`; rows of :data:`MODEL_ROW`, the slowest rank's seconds. ``models``: ``{"model": a
    ``model:`` mapping, "micro_batch", "seq_len"}``. What the matmul and tiny-block figures cannot see is in them:
    an MoE block's routing and its loop over experts, a model's own norms, activations and loss."""
    import torch.distributed as dist

    from disttrain.planner.spec import model_spec
    from disttrain.planner.workload import build, loss_of, random_batch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = _device_sync(device)
    rows = []
    for entry in models:
        mapping, micro_batch = entry["model"], int(entry["micro_batch"])
        spec = model_spec(mapping)
        seq = int(entry.get("seq_len") or spec.tokens or 1)
        g = torch.Generator().manual_seed(0)
        seconds = []
        for depth in model_depths(spec.layers):
            torch.manual_seed(0)
            with torch.device(device):
                model, kind = build(mapping, depth if spec.layers else None)
            model.to(dtype)
            inputs, targets = (t.to(device) for t in random_batch(spec, kind, micro_batch, seq, g))
            if inputs.is_floating_point():
                inputs = inputs.to(dtype)
            # the median, as a trial's steps are counted (not the fastest: a step's own noise is part of its time)
            seconds.append(_timed(lambda: loss_of(model, kind, inputs, targets).backward(), device, repeats, sync))
            del model
        found = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace of a step
        rows.append({"key": model_key(spec), "name": spec.family, "micro_batch": micro_batch, "seq_len": seq,
                     "depths": list(model_depths(spec.layers)), "seconds": found.tolist()})
    return rows


def block_sizes(device: torch.device, shapes: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The (tokens, hidden) sizes to measure blocks at: the models' own (their square ``(tokens, h, h)`` matmuls)
    and one compute-bound default."""
    default = (512, 128) if device.type == "cpu" else (8192, 1024)
    return list(dict.fromkeys([(m, k) for m, n, k in shapes if n == k] + [default]))


class _Block(torch.nn.Module):
    """A pre-norm transformer block small enough that its compute is negligible: timing it times the framework."""

    def __init__(self, hidden: int = 16, heads: int = 2):
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def measure_overheads(device: torch.device, repeats: int = 5, blocks: int = 4) -> dict[str, float]:
    """Seconds of framework work per block forward + backward (:class:`~disttrain.planner.hardware.Overheads`):
    ``blocks`` tiny blocks timed plain, under ``fully_shard``, under a tensor-parallel plan, and as one pipeline
    stage over 4 microbatches; AdamW's step and ``zero_grad`` per parameter tensor, plain and under
    ``fully_shard``. Each engine runs over a mesh of this rank alone: its hooks and DTensor dispatch are measured,
    while the collectives' latency stays in the links (measured on their own). The fastest of ``repeats`` calls:
    other work on the machine only ever adds to a fixed cost."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("all", "own"))["own"]
    sync = _device_sync(device)

    def stack() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[_Block() for _ in range(blocks)]).to(device)

    def per_block(model: torch.nn.Module, samples: int = 1) -> float:
        x = torch.randn(samples, 8, 16, device=device)
        return _timed(lambda: model(x).sum().backward(), device, repeats, sync, fastest=True,
                      min_seconds=LOCAL_SAMPLE) / blocks

    eager = per_block(stack())
    sharded = stack()
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    split = stack()
    for block in split:
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                         "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    micro = 4
    stage = PipelineStage(stack(), 0, 1, device, group=mesh.get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=micro, loss_fn=lambda out, target: out.sum())
    x, target = torch.randn(micro, 8, 16, device=device), torch.zeros(micro, device=device)
    pipelined = _timed(lambda: schedule.step(x, target=target), device, repeats, sync, fastest=True,
                       min_seconds=LOCAL_SAMPLE)
    # the schedule's own work per microbatch: what its step takes beyond running the blocks once per microbatch
    microbatch = max(0.0, pipelined / micro - blocks * eager)

    def per_tensor(model: torch.nn.Module) -> float:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(1, 8, 16, device=device)).sum().backward()  # gradients, kept across the calls

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        return _timed(step, device, repeats, sync, fastest=True, min_seconds=LOCAL_SAMPLE) / \
            sum(1 for _ in model.parameters())

    found = torch.tensor([eager, per_block(sharded), per_block(split), microbatch, per_tensor(stack()),
                          per_tensor(sharded)], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace of a step
    return dict(zip(("eager", "sharded", "tensor_parallel", "microbatch", "optimizer_tensor", "optimizer_dtensor"),
                    found.tolist()))


def measure_zero3(device: torch.device, eager: float, repeats: int = 5, blocks: int = 4) -> Optional[float]:
    """Seconds per block of a DeepSpeed ZeRO-3 step beyond the block's own work (``eager``, per block): ``blocks``
    tiny blocks trained by DeepSpeed's engine over every rank, forward, backward and step, the median step (its
    collectives' waits are part of it, as in a trial's step). DeepSpeed hooks every submodule and fetches each one's
    parameters as it enters it, in calls too small for their bytes to count: what this measures is that work and the
    fetches' latency, which FSDP2's per-unit hooks (``sharded``) do not show (on 2 CPU processes about 10 ms per
    block, where a block under FSDP2's hooks takes 1.4 ms; with FSDP2's figure instead, ZeRO-3's plans of tiny models
    were predicted 40-46% too fast). None without DeepSpeed installed (the preset's figure is used)."""
    import argparse

    import torch.distributed as dist

    try:
        import deepspeed
    except ImportError:
        return None
    from disttrain.parallel.engines.deepspeed import ZeroOptions, zero3_config
    from disttrain.patches import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()  # DeepSpeed's backend starts here: no inference-only C++ op compiled on the CPU
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(blocks)]).to(device)
    config = zero3_config(ZeroOptions(), precision="32-true", micro_batch_size=1, accumulation=1,
                          world_size=dist.get_world_size(), gradient_clipping=None, device_type=device.type)
    engine, *_ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=device.index or 0), config=config, model=model,
        model_parameters=list(model.parameters()), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        dist_init_required=False)
    x = torch.randn(1, 8, 16, device=device)

    def step() -> None:
        engine.backward(engine(x).sum())
        engine.step()

    step()  # DeepSpeed records the modules' order on the first step and prefetches by it from the second
    found = torch.tensor([_timed(step, device, repeats, _barrier_sync(device))], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    engine.destroy()
    return max(0.0, float(found.item()) / blocks - eager)


def default_shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """Square-ish matmuls from small to large, for models calibrated without their own shapes."""
    sizes = (128, 256, 512, 1024) if device.type == "cpu" else (1024, 2048, 4096, 8192)
    return [(s, s, s) for s in sizes] + [(4 * s, s, s) for s in sizes[:-1]]


def model_shapes(spec: Any, micro_batch: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The matmuls of one block of ``spec`` at ``micro_batch`` x ``seq_len`` tokens: (tokens, out, in) of the
    attention projections and the MLP (what dominates a transformer's FLOPs)."""
    tokens = max(1, micro_batch * max(1, seq_len))
    if not spec.hidden:
        return []
    h, f = spec.hidden, spec.ffn or 4 * spec.hidden
    return [(tokens, h, h), (tokens, f, h), (tokens, h, f)]


def collective_sizes(device: torch.device) -> list[int]:
    return [1 << 14, 1 << 18, 1 << 21, 1 << 22] if device.type == "cpu" else [1 << 20, 1 << 24, 1 << 27, 1 << 28]


def measure_here(device: torch.device, shapes: list[tuple[int, int, int]], repeats: int = 3,
                 quick: bool = False, models: Iterable[dict] = ()) -> Calibration:
    """Everything, measured in this process of an initialized process group (call it on every rank); ``models``
    (:func:`measure_models`) timed too. ``quick``: the links, matmul and memory only, at fewer shapes and sizes,
    one repeat, the framework's overheads left to the preset (a check of a set-up and its links in seconds, not a
    machine's figures)."""
    import torch.distributed as dist

    ladder = default_shapes(device)[:3] if quick else default_shapes(device)
    sizes = collective_sizes(device)[::2] if quick else collective_sizes(device)
    repeats = 1 if quick else repeats
    sizes_of_blocks = block_sizes(device, shapes)  # the models' own and a default, not the ladder's
    shapes = list(dict.fromkeys([tuple(s) for s in shapes] + ladder))
    matmul = measure_matmul(shapes, device, repeats)
    memory_bw, optimizer_bw = measure_memory(device, (1 << 20 if quick else 1 << 22) if device.type == "cpu"
                                             else (1 << 27), repeats)
    # a collective's time varies more than local work's: the median of 3x the repeats (9 at the default)
    nodes = node_ranks()
    if len(nodes) > 1:
        links, inter_links = measure_node_links(nodes, sizes, device, repeats=3 * repeats)
    else:
        links, inter_links = {op: measure_link(op, sizes, device, repeats=3 * repeats) for op in OPS}, None
    overlap = measure_overlap(device, sizes[-1], ladder[min(2, len(ladder) - 1)])
    overheads, blocks, timed = None, None, []
    if not quick:
        overheads = measure_overheads(device, repeats=10)
        overheads["collective"] = measure_in_step(device, (1 << 16, 1 << 18, 1 << 19), calls=20, rounds=3)
        blocks = measure_blocks(sizes_of_blocks, device, repeats=5)
        timed = measure_models(models, device, repeats=5)
        # last: DeepSpeed's set-up patches torch (its comm layer), which the models above must not meet
        zero3 = measure_zero3(device, overheads["eager"], repeats=10)
        if zero3 is not None:
            overheads["zero3"] = zero3
    return Calibration(host=socket.gethostname(), device=device_name(device), world_size=dist.get_world_size(),
                       backend=dist.get_backend(), matmul=matmul, memory_bw=memory_bw, optimizer_bw=optimizer_bw,
                       links=links, overlap=overlap, overheads=overheads, blocks=blocks, models=timed or None,
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch_version=torch.__version__,
                       inter_links=inter_links, nodes=len(nodes))


# -- launching ----------------------------------------------------------------------------------------------------
WORKER = Path(__file__).with_name("calibrate_run.py")


def calibrate(devices: int, accelerator: str = "cpu", shapes: Iterable[tuple[int, int, int]] = (),
              path: Optional[str | os.PathLike] = None, timeout: float = 600.0, quick: bool = False,
              models: Iterable[dict] = (), num_nodes: int = 1, node_rank: int = 0,
              main_address: Optional[str] = None, main_port: Optional[int] = None) -> Calibration:
    """Measure this machine on ``devices`` processes (``disttrain run``'s launcher: gloo on CPU, nccl on GPUs) and
    write the cache file (``path``, default :func:`cache_path`). ``models``: also time these models' own steps
    (:func:`measure_models`); the timings of other models the file held are kept. Over ``num_nodes`` > 1 nodes, call
    it on every node with its ``node_rank`` and node 0's ``main_address`` (and the same ``main_port``): the nodes meet
    in the launcher's static rendezvous there, and each node writes the same calibration (rank 0's figures)."""
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank} is not one of the {num_nodes} nodes' ranks (0 to {num_nodes - 1})")
    if num_nodes > 1 and not main_address:
        raise ValueError(f"{num_nodes} nodes need main_address: the address of node rank 0's machine")
    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else "cpu")
    target = Path(path) if path is not None else cache_path(device, devices * num_nodes, nodes=num_nodes)
    models = list(models)
    where = f"{devices} {accelerator} processes" + (f" on each of {num_nodes} nodes (this one node rank {node_rank})"
                                                    if num_nodes > 1 else "")
    launch = ["--num-nodes", str(num_nodes), "--node-rank", str(node_rank)] if num_nodes > 1 else []
    if main_address:
        launch += ["--main-address", main_address]
    if main_port is not None:
        launch += ["--main-port", str(main_port)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        command = [sys.executable, "-m", "disttrain.cli", "run", str(WORKER), "--devices", str(devices),
                   "--accelerator", accelerator, *launch, "--", str(out), json.dumps([list(s) for s in shapes]),
                   json.dumps(models)] + (["--quick"] if quick else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"calibration on {where} failed (exit {done.returncode}):\n" + "\n".join(tail))
        calibration = load(out)
    assert calibration is not None
    try:
        before = load(target)
    except CalibrationError:
        before = None  # measured again because it was unreadable: nothing of it to keep
    calibration.models = kept_models(before, calibration.models)
    save(calibration, target)
    return calibration


def kept_models(before: Optional[Calibration], measured: Optional[list[dict]]) -> Optional[list[dict]]:
    """The model timings of a new calibration: those measured now, after the earlier file's of other models."""
    keys = {row["key"] for row in measured or []}
    return [row for row in (before.models if before else None) or [] if row["key"] not in keys] + \
        (measured or []) or None


def cached(device: torch.device | str, world_size: int, nodes: int = 1) -> Optional[Calibration]:
    """This machine's calibration for ``world_size`` processes, None when there is none yet. Over ``nodes`` > 1
    nodes: the one measured over that many nodes, else the one of ``world_size`` processes on this host (its links
    stand for those within a node; between nodes the planner then uses the preset's figures)."""
    if nodes > 1:
        found = load(cache_path(device, world_size, nodes=nodes))
        if found is not None:
            return found
    return load(cache_path(device, world_size))


def nodes_of(world_size: int, per_node: Optional[int]) -> int:
    """The nodes ``world_size`` processes span at ``per_node`` each (1 when that does not divide them evenly)."""
    if not per_node or world_size <= per_node or world_size % per_node:
        return 1
    return world_size // per_node


def hardware_from(calibration: Calibration, base: Any) -> Any:
    """``base`` (a :class:`~disttrain.planner.hardware.Hardware` of the devices present) with the measured figures:
    the step-time model then uses them instead of the preset's peak FLOP/s x mfu and link bandwidths."""
    from dataclasses import replace

    overheads = base.overheads if calibration.overheads is None else \
        replace(base.overheads, **{k: float(v) for k, v in calibration.overheads.items()})
    return replace(base, calibration=calibration, memory_bw=calibration.memory_bw,
                   optimizer_bw=calibration.optimizer_bw, overlap=calibration.overlap, overheads=overheads)


__all__ = ["OPS", "Calibration", "CalibrationError", "Link", "cache_dir", "cache_path", "cached", "calibrate",
           "hardware_from", "kept_models", "link_points", "load", "measure_here", "measure_models",
           "measure_node_links", "model_key", "model_shapes", "node_ranks", "nodes_of", "save"]

