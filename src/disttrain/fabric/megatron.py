"""``disttrain_megatron`` for Lightning Fabric: tensor x pipeline x data parallelism."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision

from disttrain._lightning import checked_options
from disttrain.fabric.base import EngineStrategy
from disttrain.parallel.engines.megatron import MegatronEngine
from disttrain.parallel.families.base import Plan
from disttrain.parallel.split.blocks import BlockSpec


class MegatronStrategy(EngineStrategy):
    """Megatron-style 3D parallelism for ``lightning.Fabric``; options as on the Trainer strategy
    (:class:`disttrain.parallel.engines.megatron.MegatronOptions`).

    Under pipeline parallelism an HF causal LM is called as usual, ``model(input_ids=..., labels=...).loss``;
    other models are called as ``model(x, target=y)`` and return the loss (pass ``loss_fn=`` through the model's
    ``pipeline.loss_fn`` or give the strategy a module with ``loss_fn``). ``fabric.backward(loss)`` is then a
    no-op: the schedule already ran backward. Create optimizers after ``fabric.setup`` or before it: parameters
    of other stages are dropped from them.
    """

    strategy_name = "disttrain_megatron"
    engine_cls = MegatronEngine

    # BEGIN generated options: tools/strategy_signatures.py --write, from MegatronOptions (edit the dataclass)
    @checked_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = None,
        *,
        wrap_classes: BlockSpec = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: Union[bool, int] = True,
        empty_init: bool = False,
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        hybrid_shard: bool = False,
        shard_size: Optional[int] = None,
        broadcast_buffers: bool = True,
        sync_batchnorm: bool = False,
        gradient_compression: Optional[str] = None,
        compile: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        tp_plan: Optional[Plan] = None,
        pipeline_schedule: str = '1f1b',
        microbatches: Optional[int] = None,
        virtual_stages: int = 1,
        split_points: Optional[Sequence[int]] = None,
        pipeline_module: str = 'model',
        context_parallel_size: int = 1,
        context_parallel_attention: str = 'all_to_all',
        expert_parallel_size: int = 1,
    ) -> None:
        """The options of ``disttrain_megatron`` as keywords
        (:class:`~disttrain.parallel.engines.megatron.MegatronOptions`), after the arguments Fabric sets.

        Args:
            accelerator: set by Fabric from its ``accelerator``.
            parallel_devices: set by Fabric from its ``devices``.
            cluster_environment: set by Fabric (torchrun, SLURM, ...).
            precision: set by Fabric from its ``precision``.
            process_group_backend: "gloo" or "nccl"; default: the devices' own.
            timeout: seconds (or a ``timedelta``) a process may stay silent before every process ends the run; a
                collective waits a few seconds longer. Default: ``$DISTTRAIN_TIMEOUT``, else 600.
            wrap_classes: block class(es) or class name(s) to shard one unit each; default: found automatically.
            activation_checkpointing: recompute each block's activations in backward.
            cpu_offload: keep parameters, gradients and optimizer state on the CPU between uses.
            reshard_after_forward: free gathered parameters after forward (True, ZeRO-3) or keep them until backward
                (False, ZeRO-2 style: more memory, one all-gather less), or an int: reshard to that smaller group size.
            empty_init: build the model on the meta device when the Trainer/Fabric does not say (``configure_model`` /
                ``init_module()``), so no rank ever holds the whole model; shards are initialised after sharding.
            save_distributed_checkpoint: sharded (torch.distributed.checkpoint) checkpoints; False writes one full file.
            async_checkpoint: write sharded checkpoints in the background: a save copies the tensors to host memory and
                training goes on while they are written (the same folder, manifest and checksums; at most one save in
                flight; the run's end waits for the last one).
            hybrid_shard: HSDP on a 2D mesh: shard within a group of ``shard_size`` ranks (default: the processes of one
                node), replicate across groups (nodes): all-gathers stay on the fast intra-node links, only the gradient
                all-reduce crosses nodes.
            shard_size: ranks per shard group under ``hybrid_shard``; must divide the world size.
            broadcast_buffers: keep buffers (BatchNorm running statistics) equal across the data-parallel ranks: the
                first rank's after every training forward, as DDP's ``broadcast_buffers=True`` does; False lets each
                rank keep its own.
            sync_batchnorm: BatchNorm layers as SyncBatchNorm over the data-parallel ranks (GPU only, as under DDP); the
                Trainer's ``sync_batchnorm=True`` does the same.
            gradient_compression: None (gradients reduce-scattered in fp32, whatever the precision), "bf16" (in bf16:
                half the bytes) or "int8" (a quarter: a scale per chunk of 256 elements, error feedback).
            compile: ``torch.compile`` each block (after activation checkpointing, before sharding; FSDP's hooks stay
                outside the graph); the compiled code is cached under ``TORCHINDUCTOR_CACHE_DIR`` for the next run.
            tensor_parallel_size: ranks that split each block's heads and MLP (Megatron TP); must divide the head
                counts.
            pipeline_parallel_size: pipeline stages over ranks; each rank keeps only its stages' parameters.
            tp_plan: your own plan, ``{"path.in.block": ColwiseParallel(), ...}`` relative to one block; default: the
                plan of the model's family (HF Llama family, GPT-2, BERT-style encoders, timm ViT and DeiT) or the one
                an HF model's config declares (``base_model_tp_plan``: Phi-3, Gemma-2, GPT-NeoX, the MoE families and
                most HF decoders).
            pipeline_schedule: "gpipe", "1f1b", "interleaved_1f1b" or "interleaved_zero_bubble" (``virtual_stages``
                stages per rank, >= 2), "zbv" or "dualpipev" (two stages per rank in a V: rank 0 runs the first and the
                last stage). The zero-bubble schedules ("interleaved_zero_bubble", "zbv", "dualpipev") fill the bubble
                with the weight gradients' half of the backward.
            microbatches: microbatches per batch under PP (default ``2 * pipeline_parallel_size``); divides the batch.
            virtual_stages: stages per rank under "interleaved_1f1b"/"interleaved_zero_bubble" (1 means 2, the least
                they need); 2 under "zbv"/"dualpipev"; other schedules: 1.
            split_points: block indices where stages 1, 2, ... start; default: balanced by cost (forward FLOPs measured
                on the meta device, the embeddings, LM head and loss counted with the first and last stage).
            pipeline_module: attribute of the LightningModule holding the model to split/shard (default ``"model"``;
                found automatically when the attribute does not exist).
            context_parallel_size: ranks that split each sequence (context parallelism, long dialogues) of an HF
                Llama-family causal LM (Llama, Qwen2/3, Mistral), attention exact; they read the same samples and share
                FSDP's shards. The sequence length must divide by it. Not with pipeline parallelism.
            context_parallel_attention: "all_to_all" (Ulysses: heads exchanged for sequence around the model's own
                kernel; any device, packed rows, sliding windows) or "ring" (torch's ring attention: CUDA SDPA, causal,
                unpacked).
            expert_parallel_size: ranks that split the experts of an MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, any HF
                model whose config declares ``base_model_ep_plan``): each keeps ``experts / expert_parallel_size`` whole
                experts, and every token is sent to its experts' ranks and back with all-to-all (dropless). Taken from
                the data-parallel ranks (it must divide them), so it adds no ranks; FSDP shards the other weights over
                all data-parallel ranks and each expert over the ranks that hold it. With tensor parallelism the experts
                are whole on every tensor-parallel rank (attention is split). Not with pipeline or context parallelism.
        """
        options = {"wrap_classes": wrap_classes, "activation_checkpointing": activation_checkpointing,
                   "cpu_offload": cpu_offload, "reshard_after_forward": reshard_after_forward, "empty_init": empty_init,
                   "save_distributed_checkpoint": save_distributed_checkpoint, "async_checkpoint": async_checkpoint,
                   "hybrid_shard": hybrid_shard, "shard_size": shard_size, "broadcast_buffers": broadcast_buffers,
                   "sync_batchnorm": sync_batchnorm, "gradient_compression": gradient_compression, "compile": compile,
                   "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
                   "tp_plan": tp_plan, "pipeline_schedule": pipeline_schedule, "microbatches": microbatches,
                   "virtual_stages": virtual_stages, "split_points": split_points, "pipeline_module": pipeline_module,
                   "context_parallel_size": context_parallel_size,
                   "context_parallel_attention": context_parallel_attention,
                   "expert_parallel_size": expert_parallel_size}
        self._init_adapter(accelerator, parallel_devices, cluster_environment, precision, process_group_backend,
                           timeout, options)
    # END generated options
