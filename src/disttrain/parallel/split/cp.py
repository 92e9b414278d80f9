"""Context parallelism (CP) for the HF Llama family's causal LMs (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``): every sequence of a batch is split over the ranks of a ``cp`` mesh
dimension, and attention stays exact.

    ctx = apply_context_parallel(model, mesh["cp"])               # first; then TP, activation checkpointing, FSDP
    out = model(input_ids=ids, labels=labels, position_ids=pos)   # the SAME full (B, T) batch on every cp rank
    out.loss.backward()                                           # then average the gradients over cp (FSDP does)

Each rank computes T/cp tokens of every layer: the embedding output is sliced before the first decoder layer, the
rotary cos/sin before every layer, and the final norm and LM head see local tokens only (the logits are (B, T/cp, V),
in training and in evaluation; ``model.context_parallel.gather(logits)`` assembles the whole sequence, a
collective). HF still builds its attention masks from the full ``position_ids`` (packed rows, sliding windows): the
slicing happens after that, in forward pre-hooks on the decoder layers.

Attention:

- ``"all_to_all"`` (Ulysses, the default, any device and kernel): an implementation registered in transformers'
  ``AttentionInterface`` wraps the model's own kernel (eager, sdpa, flash_attention_2, ...). q/k/v (B, heads, T/cp, D)
  are exchanged by one all-to-all into (B, heads/cp, T, D), the kernel runs over the whole sequence with the
  full-sequence mask HF built, and the output goes back by the inverse all-to-all. The heads (per rank, after any
  tensor parallelism) must divide by cp; key/value heads fewer than cp are repeated when cp is a multiple of them.
- ``"ring"``: torch's own ring attention (``torch.distributed.tensor.experimental``, CUDA SDPA flash/efficient kernels,
  causal only, its head-tail load balancer). Not for CPU, packed rows, sliding windows or non-SDPA attention.

The loss is the one a single process computes: the mean cross-entropy over every token of the (B, T) batch whose
shifted label is not -100. ``output.loss`` carries that value on every cp rank; its gradient is scaled so that the
AVERAGE of the cp ranks' parameter gradients is the one-process gradient (what FSDP's reduce-scatter over a mesh that
includes the cp ranks computes). Without FSDP, average the gradients over ``ctx.group`` yourself.

Memory: activations are divided by cp, except the attention mask. With eager or sdpa, HF materialises a (B, 1, T, T)
mask for packed rows (and sliding windows), and every rank needs all of it since it attends over the whole sequence;
flash_attention_2 reads packed rows from ``position_ids`` and has no such mask. The model is for training and
evaluation forwards: it keeps no KV cache (``generate`` is not split).
"""

from __future__ import annotations

import copy
import difflib
import functools
import sys
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from disttrain.parallel.families.llama import LLAMA

ATTENTIONS = ("all_to_all", "ring")
IGNORE_INDEX = -100  # HF's label for "no loss here"
# The attribute of each attention module that leads the registered (model-independent) kernels to their model's CP.
_CONTEXT_ATTR = "_disttrain_context_parallel"


class ContextParallel:
    """What :func:`apply_context_parallel` did to a model; also reachable as ``model.context_parallel``.

    ``cp``: ranks one sequence is split over; ``rank``: this rank's place among them; ``mesh`` / ``group``: the cp
    mesh and its process group; ``attention``: "all_to_all" or "ring"; ``kernel``: the attention implementation the
    model had, which the all-to-all wraps. ``local(tensor)`` is this rank's share of a full-length tensor, for users
    who compute their own loss from the (B, T/cp, V) logits (or call ``loss(logits, labels)``); ``gather(tensor)``
    the whole sequence of a local one (a collective).
    """

    def __init__(self, mesh: DeviceMesh, attention: str, kernel: str, kernel_config: Any,
                 model_config: Any = None, name: Optional[str] = None) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.cp = mesh.size()
        self.rank = mesh.get_local_rank()
        self.attention = attention
        self.kernel = kernel
        # The model's config as the wrapped kernel must see it: flash kernels look themselves up by
        # config._attn_implementation, which on the model now names the CP wrapper.
        self._kernel_config = kernel_config
        self._shared_mask: tuple[Callable[[], Any], Callable[[], Any]] = (lambda: None, lambda: None)
        self._model_config, self._name = model_config, name  # the model's config and the CP attention it names

    # -- tokens of this rank -----------------------------------------------------------------------------------
    def check_length(self, length: int) -> None:
        """Raise unless a row of ``length`` tokens splits evenly over the cp ranks."""
        chunks = 2 * self.cp if self.attention == "ring" else self.cp
        if length % chunks:
            why = " (the ring's head-tail balancer cuts each row in 2*cp pieces)" if self.attention == "ring" else ""
            raise ValueError(f"sequence length T={length} is not divisible by {chunks} (cp={self.cp}){why}: make the"
                             f" packed row length a multiple of {chunks}, e.g. {-(-length // chunks) * chunks}")

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``tensor`` (full length on ``dim``), in the order the model computes them: a
        contiguous slice for "all_to_all", the head-tail pair of chunks for "ring"."""
        length = tensor.shape[dim]
        self.check_length(length)
        if self.attention == "ring":
            return tensor.index_select(dim, self._ring_order(length, tensor.device).view(self.cp, -1)[self.rank])
        return tensor.narrow(dim, self.rank * (length // self.cp), length // self.cp)

    def gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full-length tensor in natural token order from every rank's ``local`` part (no gradient)."""
        with torch.no_grad():
            parts = [torch.empty_like(tensor) for _ in range(self.cp)]
            dist.all_gather(parts, tensor.contiguous(), group=self.group)
            full = torch.cat(parts, dim=dim)
            if self.attention == "ring":
                full = full.index_select(dim, torch.argsort(self._ring_order(full.shape[dim], full.device)))
        return full

    def _ring_order(self, length: int, device: torch.device) -> torch.Tensor:
        """The token order of torch's head-tail load balancer: rank r holds chunks r and 2*cp-1-r of every row."""
        from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

        return _HeadTailLoadBalancer(length, self.cp, device)._generate_indices()[0]

    # -- loss --------------------------------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             num_items_in_batch: Optional[torch.Tensor | int] = None) -> torch.Tensor:
        """HF's causal-LM loss of the whole (B, T) batch from this rank's logits (B, T/cp, V) and the full labels:
        the same value on every cp rank, a gradient whose average over the cp ranks is the one-process gradient.
        ``num_items_in_batch``: divide the summed loss by it instead of this batch's count of labelled tokens (HF's
        gradient-accumulation convention)."""
        targets = shift_labels(labels)
        count = (targets != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
        return self._loss(logits, self.local(targets), count)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
        # Every rank holds the full labels, so the global count of labelled tokens needs no communication.
        local = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum") / count
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        if not local.requires_grad:
            return total
        # Backward from every rank's local term reaches all ranks' parameters through the attention's exchanges, so
        # the ranks' gradients SUM to d(sum of local terms) = d(loss). Data-parallel reductions (FSDP) AVERAGE over
        # the cp ranks: scale by cp so the average is the one-process gradient; the value returned is the global loss.
        scaled = local * self.cp
        return scaled + (total - scaled).detach()

    # -- the model's forward -----------------------------------------------------------------------------------
    def forward(self, model_forward: Callable[..., Any], input_ids: Optional[torch.Tensor] = None, *,
                labels: Optional[torch.Tensor] = None, num_items_in_batch: Any = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """The CP forward of the causal LM (installed as ``model.forward``): the full batch in, this rank's tokens
        computed; the loss as one process computes it; this rank's logits (B, T/cp, V)."""
        if self._model_config is not None and self._model_config._attn_implementation != self._name:
            # Without the CP attention each rank would attend over its own tokens only: wrong, silently.
            raise ValueError(f"the model's attn_implementation was changed to"
                             f" {self._model_config._attn_implementation!r} after apply_context_parallel (which set"
                             f" {self._name!r}); choose the attention before applying context parallelism")
        inputs = {"input_ids": input_ids, **kwargs}
        full = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if full is None:
            raise ValueError("context parallelism needs input_ids or inputs_embeds of the full (B, T) batch")
        self.check_length(full.shape[1])
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("context parallelism takes no padding attention_mask (it has zeros): pack the rows instead"
                             " (several dialogues per row, position_ids restarting at 0) and mark unused tokens with"
                             " labels -100, or pass no attention_mask")
        inputs["use_cache"] = False  # a KV cache would hold this rank's tokens only
        targets, count = None, None
        if labels is not None:
            targets = shift_labels(labels)  # (B, T), shifted over the full rows
            count = (targets != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
        if self.attention == "ring":
            inputs, targets = self._shard_for_ring(inputs, targets)
        elif targets is not None:
            targets = self.local(targets)
        out = model_forward(**inputs)  # labels withheld: HF would compute its loss against the full labels
        logits = out.logits  # (B, T/cp, V)
        loss = None if targets is None else self._loss(logits, targets, count)
        # Evaluation keeps the local logits too: the full (B, T, V) fp32 logits of a long sequence on every rank is
        # the memory context parallelism exists to avoid (32k tokens x 32k vocabulary: 4 GiB a sample).
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _shard_for_ring(self, inputs: dict[str, Any],
                        targets: Optional[torch.Tensor]) -> tuple[dict[str, Any], Optional[torch.Tensor]]:
        """Shard the inputs, positions and shifted labels with torch's head-tail load balancer, the token order its
        ring kernels assume. HF then sees local tokens only (and no mask: the ring is causal-only)."""
        from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer

        name = "input_ids" if inputs["input_ids"] is not None else "inputs_embeds"
        batch, length = inputs[name].shape[:2]
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=inputs[name].device)
        if bool((positions.diff(dim=-1) != 1).any()):
            raise ValueError("attention='ring' (torch's ring attention) is causal-only and cannot mask packed rows"
                             " (position_ids restart inside a row): use attention='all_to_all'")
        inputs.pop("attention_mask", None)
        buffers = {name: inputs[name], "position_ids": positions.expand(batch, length)}
        if targets is not None:
            buffers["labels"] = targets
        shards = _context_parallel_shard(self.mesh, buffers, {key: 1 for key in buffers},
                                         load_balancer=_HeadTailLoadBalancer(length, self.cp, inputs[name].device))
        targets = shards.pop("labels", None)
        return {**inputs, **shards}, targets

    # -- hooks and kernels -------------------------------------------------------------------------------------
    def split_layer_inputs(self, layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Forward pre-hook of every decoder layer ("all_to_all"): slice the rotary cos/sin (HF computes them once
        for the full sequence) and, before the first layer, the embedding output. Stateless, so the recomputation
        of activation checkpointing slices the same way."""
        rotary = kwargs.get("position_embeddings")
        if rotary is None:
            raise ValueError(f"context parallelism expects {type(layer).__name__} to receive position_embeddings="
                             "(cos, sin) from the model; call the whole model, not a layer")
        full = rotary[0].shape[1]
        kwargs["position_embeddings"] = tuple(self.local(t) for t in rotary)
        # The embedding output is cloned: a saved view of it would keep the full (B, T, H) tensor alive until
        # backward. (The cos/sin views are shared by all layers: one full copy, smaller than a local one per layer.)
        if args:
            if args[0].shape[1] == full:
                args = (self.local(args[0]).clone(), *args[1:])
        elif kwargs["hidden_states"].shape[1] == full:
            kwargs["hidden_states"] = self.local(kwargs["hidden_states"]).clone()
        return args, kwargs

    def shared_mask(self, mask: Any, dtype: torch.dtype) -> Any:
        """HF's boolean mask as the additive float mask (0 / -inf) SDPA makes of it, made once per forward.

        SDPA converts a boolean mask on every call and saves its copy for backward: one (B, 1, T, T) float copy per
        layer, the largest activation of packed rows, and one that context parallelism does not divide (every rank
        attends over the whole sequence). HF passes the same mask object to every layer: convert it once and let
        the layers share it. Weak references only, so the copy lives as long as the autograd graph saving it."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            return mask
        source, converted = self._shared_mask
        additive = converted() if source() is mask else None
        if additive is None or additive.dtype != dtype:
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._shared_mask = (weakref.ref(mask), weakref.ref(additive))
        return additive

    def kernel_view(self, module: nn.Module, groups: int) -> "_KernelView":
        return _KernelView(module, self._kernel_config, groups)


class _KernelView:
    """The attention module as the wrapped kernel must see it on this rank: its config names the model's own
    kernel, and its query/key-value group size is the one of the heads this rank holds after the all-to-all (which
    differs from the module's when key/value heads were repeated). Everything else is the module's."""

    def __init__(self, module: nn.Module, config: Any, groups: int) -> None:
        self._module = module
        self.config = config
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the label each position predicts (the next token's); the last position predicts nothing.
    Shifted over the FULL row, before any split: a rank's last token predicts the next rank's first."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _context_of(module: nn.Module) -> ContextParallel:
    ctx = getattr(module, _CONTEXT_ATTR, None)
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__} uses a context-parallel attention implementation but"
                           " apply_context_parallel was not applied to its model; call it on the model itself")
    return ctx


def _model_kernel(module: nn.Module, kernel: str) -> Callable[..., Any]:
    """The model's own attention function for ``kernel``: registered ones from transformers' interface, "eager"
    from the model's modeling file (each family has its own eager_attention_forward)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(kernel, eager)


def check_heads(heads: int, kv_heads: int, cp: int, where: str = "the model") -> None:
    """Raise unless the all-to-all can split ``heads`` query and ``kv_heads`` key/value heads over ``cp`` ranks."""
    if heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0):
        return
    works = [c for c in range(1, heads + 1) if heads % c == 0 and (kv_heads % c == 0 or c % kv_heads == 0)]
    raise ValueError(f"context parallelism (all-to-all) splits attention heads over cp={cp}, but {where} has"
                     f" num_attention_heads={heads} and num_key_value_heads={kv_heads}; choose cp in {works} (cp must"
                     " divide the query heads, and divide or be a multiple of the key/value heads)")


def _heads_to_sequence(cp: int, group: dist.ProcessGroup, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """(B, H_i, T/cp, D) per tensor -> (B, H_i/cp, T, D): rank j receives heads [j*H_i/cp, (j+1)*H_i/cp) of every
    rank's tokens, in rank (= token) order. q, k and v travel in one all-to-all."""
    batch, _, local_len, dim = tensors[0].shape
    # (cp, B, H_i/cp, T/cp, D): chunk j (dim 0) is what rank j receives.
    packed = torch.cat([t.reshape(batch, cp, t.shape[1] // cp, local_len, dim).transpose(0, 1) for t in tensors],
                       dim=2).contiguous()
    received = funcol.all_to_all_single_autograd(packed, None, None, group)  # chunk i: rank i's tokens
    full = received.permute(1, 2, 0, 3, 4).reshape(batch, -1, cp * local_len, dim)  # (B, sum H_i/cp, T, D)
    return list(full.split([t.shape[1] // cp for t in tensors], dim=1))


def _sequence_to_heads(cp: int, group: dist.ProcessGroup, out: torch.Tensor) -> torch.Tensor:
    """(B, T, H/cp, D), the kernel's output -> (B, T/cp, H, D): the inverse exchange."""
    batch, length, heads, dim = out.shape
    packed = out.reshape(batch, cp, length // cp, heads, dim).transpose(0, 1).contiguous()  # chunk j: rank j's tokens
    received = funcol.all_to_all_single_autograd(packed, None, None, group)  # chunk i: rank i's heads
    return received.permute(1, 2, 0, 3, 4).reshape(batch, length // cp, cp * heads, dim)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered "all_to_all" attention: q (B, Hq, T/cp, D), k/v (B, Hkv, T/cp, D) in, (B, T/cp, Hq, D) out.

    Each rank runs the model's kernel on Hq/cp heads over the WHOLE sequence, so the causal work is the same on every
    rank whatever the split: a contiguous split needs no load balancing (unlike the ring)."""
    ctx = _context_of(module)
    cp = ctx.cp
    kernel = _model_kernel(module, ctx.kernel)
    if ctx.kernel == "sdpa":
        attention_mask = ctx.shared_mask(attention_mask, query.dtype)
    if cp == 1:
        return kernel(ctx.kernel_view(module, module.num_key_value_groups), query, key, value, attention_mask, **kwargs)
    check_heads(query.shape[1], key.shape[1], cp, where="this rank (after any tensor parallelism)")
    if key.shape[1] < cp:
        # Fewer key/value heads than ranks: repeat each so that every rank receives the one key/value head its query
        # heads use (the query heads of one rank all fall in one group since cp is a multiple of the kv heads).
        repeat = cp // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    query, key, value = _heads_to_sequence(cp, ctx.group, query, key, value)
    out, _ = kernel(ctx.kernel_view(module, query.shape[1] // key.shape[1]), query, key, value, attention_mask,
                    **kwargs)  # (B, T, Hq/cp, D)
    # The attention weights (eager) cover this rank's heads only: not returned.
    return _sequence_to_heads(cp, ctx.group, out), None


def ring_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered "ring" attention: q/k/v of this rank's head-tail tokens as DTensors sharded on the sequence,
    so that SDPA dispatches to torch's ring flash/efficient kernels (forward and backward)."""
    from torch.distributed.tensor import DTensor, Shard

    ctx = _context_of(module)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # the ring kernels take as many key/value heads as query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    q, k, v = (DTensor.from_local(t.contiguous(), ctx.mesh, [Shard(2)], run_check=False) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
    return out.to_local().transpose(1, 2).contiguous(), None  # (B, T/cp, H, D)


def _register(attention: str, kernel: str) -> str:
    """Register the CP attention (and the mask format it takes) in transformers' interfaces; return its name."""
    if attention == "ring":
        # No mask function: HF then builds no mask (its rule for kernels without one), and the ring's is_causal
        # expresses the causal structure (packed rows and sliding windows are refused).
        name = "disttrain_cp_ring"
        AttentionInterface.register(name, ring_attention)
        return name
    name = f"disttrain_cp_all_to_all_{kernel}"
    AttentionInterface.register(name, ulysses_attention)
    if kernel in ALL_MASK_ATTENTION_FUNCTIONS:
        # The wrapped kernel sees the full sequence, so it takes the full-sequence mask in its own format.
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kernel])
    return name


def _unwrap(module: nn.Module) -> nn.Module:
    """The decoder layer inside an activation-checkpointing wrapper."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _uses_sliding_window(config: Any) -> bool:
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if (getattr(config, "model_type", None) not in LLAMA.model_types or layers is None
            or not isinstance(getattr(model, "lm_head", None), nn.Module)):
        raise ValueError(f"context parallelism splits the HF Llama family's causal LMs (LlamaForCausalLM,"
                         f" Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM), not {type(model).__name__}:"
                         " for long rows of another model use activation_checkpointing=True, tensor parallelism"
                         " (tensor_parallel_size) or a smaller micro batch")
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError(f"context parallelism is already applied to this {type(model).__name__}; apply it once")


def _check_ring(model: nn.Module, mesh: DeviceMesh, kernel: str) -> None:
    if mesh.device_type != "cuda":
        raise ValueError(f"attention='ring' runs torch's ring attention on CUDA SDPA (flash/efficient) kernels only,"
                         f" not on {mesh.device_type}; use attention='all_to_all'")
    if kernel != "sdpa":
        raise ValueError(f"attention='ring' replaces SDPA, but the model uses attn_implementation={kernel!r}; use"
                         " attention='all_to_all' (it wraps any kernel) or load the model with attn_implementation="
                         "'sdpa'")
    if _uses_sliding_window(model.config):
        raise ValueError("attention='ring' is causal-only and cannot apply the model's sliding window; use"
                         " attention='all_to_all'")


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, *, attention: str = "all_to_all") -> ContextParallel:
    """Make ``model`` (an HF Llama-family causal LM) compute each sequence split over the ranks of ``cp_mesh`` (a 1-D
    mesh, e.g. ``mesh["cp"]``), in place; returns the :class:`ContextParallel` (also ``model.context_parallel``).

    Every cp rank then calls the model with the same full batch (``input_ids``/``labels``/``position_ids`` of shape
    (B, T), T a multiple of cp; no padding mask): see the module docstring for what it returns. Apply it first, then
    tensor parallelism, activation checkpointing and FSDP: its hooks sit on the decoder layers of
    ``model.model.layers`` and its state on their ``self_attn`` modules, which those wrappers keep (so do layers
    already inside a checkpoint wrapper). Choose the model's attention implementation before: the all-to-all wraps it.
    """
    _check_model(model)
    if attention not in ATTENTIONS:
        close = difflib.get_close_matches(str(attention), ATTENTIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"attention={attention!r} is not a context-parallel attention; {hint}choose one of"
                         f" {ATTENTIONS}")
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh has {cp_mesh.ndim} dimensions {cp_mesh.mesh_dim_names}; pass its 1-D cp dimension,"
                         " e.g. mesh['cp']")
    config = model.config
    kernel = config._attn_implementation or "eager"
    if attention == "all_to_all" and config.num_attention_heads % cp_mesh.size():
        check_heads(config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads,
                    cp_mesh.size())
    if attention == "ring":
        _check_ring(model, cp_mesh, kernel)
        from torch.distributed.tensor.experimental._attention import _enable_context_parallel_dispatcher

        # torch routes SDPA on sequence-sharded DTensors to its ring kernels only while this dispatcher is on. It must
        # stay on past the forward (torch's own `context_parallel` context manager turns it off on exit), because
        # backward dispatches the SDPA backward ops on those DTensors too; it affects DTensor SDPA calls only.
        _enable_context_parallel_dispatcher()
    kernel_config = copy.copy(config)
    kernel_config._attn_implementation_internal = kernel
    name = _register(attention, kernel)
    ctx = ContextParallel(cp_mesh, attention, kernel, kernel_config, config, name)
    for layer in model.model.layers:
        setattr(_unwrap(layer).self_attn, _CONTEXT_ATTR, ctx)
        if attention == "all_to_all":
            layer.register_forward_pre_hook(ctx.split_layer_inputs, with_kwargs=True)
    # Set directly, as set_attn_implementation would: its checks treat a name containing "flash" as a hub kernel.
    config._attn_implementation = name
    model.forward = functools.wraps(model.forward)(functools.partial(ctx.forward, model.forward))
    model.context_parallel = ctx
    return ctx
