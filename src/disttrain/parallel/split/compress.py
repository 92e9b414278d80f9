"""Compressed gradient reduction for ``disttrain_fsdp`` (a custom FSDP2 reduce-scatter) and ``disttrain_ddp`` (a DDP
communication hook), and the count of the bytes each rank sends to reduce gradients.

int8 with a scale per chunk and error feedback: each rank quantises its gradients to int8, one fp32 scale per
``BLOCK`` elements (the chunk's absolute maximum / 127), and keeps what the rounding lost to add to the next step's
gradients (error feedback: nothing is lost, only delayed, which is what keeps the loss curve on the uncompressed
one). About a quarter of fp32's bytes go over the wire (1 + 4/BLOCK bytes per element instead of 4).

Why not an int8 reduce-scatter: a collective that sums int8 overflows (two ranks' 127 is 254), and the ranks' scales
differ, so quantised values cannot be summed as they are anyway. Each rank instead sends rank ``r`` the quantised
chunk ``r`` of its gradients and the chunk's scales (``all_to_all_single``, which gloo and nccl both have for int8);
the receiver dequantises every rank's part and sums in fp32. For DDP, which needs the whole sum on every rank, the
reduced chunk is quantised again (with error feedback of its own) and all-gathered: 2 (w-1)/w bytes per element in
all, as a ring all-reduce sends, but int8, whatever the world size w (an all-gather of every rank's whole int8
gradients would send (w-1) bytes per element: more than fp32's all-reduce from w=9 on).

Bytes are counted as each collective's bandwidth-optimal algorithm sends them from one rank: reduce-scatter and
all-to-all (w-1)/w of the buffer, all-reduce 2 (w-1)/w, all-gather (w-1) times the rank's part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# torch exports the interface only from the private module (FSDPModule.set_custom_reduce_scatter takes one).
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

#: Elements per fp32 scale: the scales cost 4/BLOCK bytes per element (1.6%); a smaller chunk follows the gradients'
#: range more closely (outliers spoil fewer neighbours) at more bytes.
BLOCK = 256


def wire(compression: Optional[str], all_gathered: bool = True, rank: int = 1) -> dict[str, Any]:
    """What ``compression`` does to a gradient reduction, as the strategies' layouts declare it (``Grads``): bytes
    per element on the wire (or PowerSGD's ``rank``), and the time encoding and decoding them takes as passes over
    the fp32 gradients at memory speed (a pass: ``c = a + b`` over them), as timed on one CPU core. 16-bit: a cast
    out and one back, 2 passes. int8 (:func:`int8_reduce_scatter`): error feedback in and out, the block maxima,
    scaling, rounding, clamping, packing, and each received part dequantised and summed: 25 passes on 4.85M elements
    (its many small temporaries); ``all_gathered`` (DDP) quantises the reduced chunk again and dequantises the
    gathered whole: 36. PowerSGD (torch's hook): error feedback, the products with the factors, orthogonalising and
    the product back: 14 passes on a 1.6M-element model at rank 1; the uncompressed tensors, P, then Q: three
    all-reduces per bucket."""
    if compression in ("bf16", "fp16"):
        return {"wire_bytes": 2.0, "codec_passes": 2}
    if compression == "int8":
        return {"wire_bytes": 1 + 4 / BLOCK, "codec_passes": 36 if all_gathered else 25}
    if compression == "powersgd":
        return {"low_rank": rank, "low_rank_calls": 3, "codec_passes": 14}
    return {}


class Traffic:
    """Bytes this rank has sent to reduce gradients since the model was set up (``bytes_sent``), shared by every
    FSDP unit's reduce-scatter or by the DDP hook."""

    def __init__(self) -> None:
        self.bytes_sent = 0

    def add(self, nbytes: float) -> None:
        self.bytes_sent += int(nbytes)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., n), n a multiple of BLOCK -> int8 values (..., n // BLOCK, BLOCK) and fp32 scales
    (..., n // BLOCK)."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    scales = blocks.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    values = torch.round(blocks / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize`: fp32 (..., n)."""
    return (values.float() * scales.unsqueeze(-1)).flatten(-2)


def padded(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 values (rows, k, BLOCK) and their fp32 scales (rows, k) as one int8 tensor (rows, k * (BLOCK + 4)): one
    collective instead of two (each costs a round trip, which dominates the small units of a sharded model)."""
    return torch.cat([values.flatten(1), scales.view(torch.int8)], dim=1)


def unpack(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack`."""
    k = payload.shape[1] // (BLOCK + 4)
    values, scales = payload.split([k * BLOCK, k * 4], dim=1)
    return values.unflatten(1, (k, BLOCK)), scales.contiguous().view(torch.float32)


def int8_reduce_scatter(chunks: torch.Tensor, residual: torch.Tensor, group: Optional[dist.ProcessGroup],
                        traffic: Traffic) -> torch.Tensor:
    """Collective: the sum over the ranks of their ``chunks[r]`` (fp32, (n,)) on rank ``r``, sent as int8.

    ``chunks``: (world, n), n a multiple of BLOCK, chunk ``r`` for rank ``r``; ``residual`` (the same shape) holds
    what the last quantisation lost: it is added first and replaced by this one's loss (error feedback)."""
    world = dist.get_world_size(group)
    compensated = chunks.float() + residual
    values, scales = quantize(compensated)  # (world, n // BLOCK, BLOCK), (world, n // BLOCK)
    residual.copy_(compensated - dequantize(values, scales))
    payload = pack(values, scales)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)  # row r goes to rank r; row s comes from rank s
    traffic.add((world - 1) / world * payload.numel())
    return dequantize(*unpack(received)).sum(0)  # the ranks' parts summed in fp32


def reduce_scatter_factor(group: dist.ProcessGroup, tensor: torch.Tensor) -> int:
    """What a reduce-scatter sends, in units of the minimum ((N - 1) / N of the input): 2 for a CPU tensor on gloo,
    which reduce-scatters through an all-reduce (read on the interface: a 4 MB reduce-scatter between 2 hosts sends
    4 MB, as the all-reduce does, not 2 MB), 1 for the backends that reduce-scatter directly (NCCL)."""
    return 2 if tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group)) else 1


class CountedReduceScatter(ReduceScatter):
    """FSDP2's own reduce-scatter (``reduce_scatter_single`` in the reduce dtype: fp32, or bf16 under
    ``gradient_compression="bf16"``), counting the bytes it sends."""

    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        world = group.size()
        self.traffic.add(reduce_scatter_factor(group, input_tensor) * (world - 1) / world * input_tensor.numel()
                         * input_tensor.element_size())
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class Int8ReduceScatter(CountedReduceScatter):
    """FSDP2's reduce-scatter of one unit's flat gradients sent as int8 (:func:`int8_reduce_scatter`), with the
    unit's error-feedback residual. The unit must sum (``set_force_sum_reduction_for_comms(True)``): FSDP then
    divides by the world size itself, after the reduction."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__(traffic)
        self.residual: Optional[torch.Tensor] = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"the int8 reduce-scatter sums; FSDP asked for {op} (call"
                               " set_force_sum_reduction_for_comms(True) on the unit)")
        world, n = group.size(), output_tensor.numel()
        width = padded(n, BLOCK)
        chunks = input_tensor.view(world, n)
        if width != n:
            chunks = torch.nn.functional.pad(chunks, (0, width - n))
        if self.residual is None or self.residual.shape != chunks.shape:
            self.residual = torch.zeros(chunks.shape, dtype=torch.float32, device=chunks.device)
        summed = int8_reduce_scatter(chunks, self.residual, group, self.traffic)
        output_tensor.copy_(summed[:n])
        return None  # done: FSDP waits on nothing it did not ask for (async_op is never set by FSDP)


def install_reduce_scatter(units: Sequence[Any], compression: Optional[str], traffic: Traffic) -> None:
    """Give every FSDP unit (``FSDPModule``) a reduce-scatter that counts its bytes into ``traffic``: int8
    (:class:`Int8ReduceScatter`, one residual per unit) under ``compression="int8"``, else FSDP's own collective
    (bf16 comes from the units' MixedPrecisionPolicy ``reduce_dtype``)."""
    for unit in units:
        if compression == "int8":
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_custom_reduce_scatter(Int8ReduceScatter(traffic))
        else:
            unit.set_custom_reduce_scatter(CountedReduceScatter(traffic))


class HookState:
    """The state of :func:`int8_hook` and :func:`counted_hook`: the group, the byte count and, per DDP bucket, the
    error-feedback residuals of the int8 reduce-scatter (``sent``) and all-gather (``gathered``) phases."""

    def __init__(self, traffic: Traffic, group: Optional[dist.ProcessGroup] = None) -> None:
        self.traffic = traffic
        self.group = group
        self.sent: dict[int, torch.Tensor] = {}
        self.gathered: dict[int, torch.Tensor] = {}

    def residual(self, table: dict[int, torch.Tensor], index: int, shape: torch.Size,
                 device: torch.device) -> torch.Tensor:
        # DDP rebuilds its buckets after the first step: a bucket whose size changed starts without a residual.
        if index not in table or table[index].shape != shape:
            table[index] = torch.zeros(shape, dtype=torch.float32, device=device)
        return table[index]


def ddp_hook(fn: Any) -> Any:
    """DDP checks a hook's annotations by identity (``bucket`` must be ``dist.GradBucket``); with postponed
    annotations they are strings: give it the objects."""
    fn.__annotations__ = {"state": HookState, "bucket": dist.GradBucket,
                          "return": torch.futures.Future[torch.Tensor]}
    return fn


@ddp_hook
def int8_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over the ranks, sent as int8 both ways (a quantised
    reduce-scatter, then an all-gather of each rank's reduced chunk quantised again), error feedback in each phase.

    The collectives run synchronously and the future is returned complete: with two phases depending on each other
    a chain of futures would save nothing on gloo, whose collectives run on CPU threads anyway."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    n = buffer.numel()
    width = padded(math.ceil(n / world), BLOCK)
    chunks = torch.nn.functional.pad(buffer.float(), (0, world * width - n)).view(world, width)
    sent = state.residual(state.sent, bucket.index(), chunks.shape, buffer.device)
    mine = int8_reduce_scatter(chunks, sent, state.group, state.traffic) / world  # (width,) the mean of my chunk
    gathered = state.residual(state.gathered, bucket.index(), mine.shape, buffer.device)
    compensated = mine + gathered
    values, scales = quantize(compensated.unsqueeze(0))  # (1, width // BLOCK, BLOCK), (1, width // BLOCK)
    gathered.copy_(compensated - dequantize(values, scales)[0])
    payload = pack(values, scales)
    everyone = payload.new_empty((world, payload.shape[1]))
    dist.all_gather_into_tensor(everyone, payload, group=state.group)
    state.traffic.add((world - 1) * payload.numel())
    buffer.copy_(dequantize(*unpack(everyone)).flatten()[:n])
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def counted_hook(hook: Any, element_size: Optional[int] = None) -> Any:
    """``hook`` (torch's all-reduce, fp16 or bf16 hook, state: the process group) with its bytes counted: a ring
    all-reduce of the bucket in ``element_size`` bytes per element (default: the bucket's own)."""

    def counted(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        world = dist.get_world_size(state.group)
        size = element_size or bucket.buffer().element_size()
        state.traffic.add(2 * (world - 1) / world * bucket.buffer().numel() * size)
        return hook(state.group, bucket)

    counted.__name__ = counted.__qualname__ = f"counted_{hook.__name__}"
    return ddp_hook(counted)


DDP_HOOKS = {
    None: counted_hook(default_hooks.allreduce_hook),
    "fp16": counted_hook(default_hooks.fp16_compress_hook, 2),
    "bf16": counted_hook(default_hooks.bf16_compress_hook, 2),
    "int8": int8_hook,
}
