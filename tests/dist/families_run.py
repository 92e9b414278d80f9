"""disttrain_megatron (Fabric) on models beyond the tiny Llama, each against one process in this script.

Usage: families_run.py OUT SPEC MODEL [MODEL ...]
MODEL: gpt2 (tied embeddings), gpt2-untied, bert (BertForSequenceClassification), roberta, qwen3 (tied),
qwen3-untied, llama-bias (attention_bias=True), vit-qknorm (timm ViT, qk_norm=True), t5; through the plans their HF
configs declare: phi3, neox, gemma2 (tied), gemma2-untied, qwen2-moe, mixtral, qwen3-moe; timm deit (distilled),
eva02; gpt2-userplan and
bert-userplan, qwen3-userplan: the model with a ``tp_plan`` written with torch's own styles (as a user would; the
Qwen3 plan does not mention its per-head q/k norms).

Per model: 2 optimizer steps on the same batches in both runs; the losses, the full state after training gathered
by ``export_full`` and the DCP checkpoint consolidated offline (``full_model_state``) next to the one-process state
(largest relative difference per tensor), HF's own ``from_pretrained`` on a ``disttrain export --to hf``
directory (logits against the reference), and the checkpoint resumed into a model with other weights under the
same layout: its next step's loss. A model the strategy refuses records the error line instead.
"""

import copy
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F

import disttrain  # noqa: F401  (registers the strategy names)

sys.path.insert(0, os.path.dirname(__file__))
from common import strategy_from_spec, tmpdir, write_result  # noqa: E402

spec, names = sys.argv[2], sys.argv[3:]
VOCAB, SEQ, BATCH, LABELS, STEPS = 96, 16, 4, 3, 2


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, max_position_embeddings=64, use_cache=False)
    name = name.removesuffix("-userplan")
    if name.startswith("gpt2"):
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                               tie_word_embeddings=name == "gpt2")
        return tf.GPT2LMHeadModel(config)
    if name in ("bert", "roberta"):
        cls = tf.BertConfig if name == "bert" else tf.RobertaConfig
        config = cls(**{**small, "max_position_embeddings": 72}, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=LABELS, pad_token_id=1)
        return (tf.BertForSequenceClassification if name == "bert" else tf.RobertaForSequenceClassification)(config)
    if name.startswith("qwen3"):
        config = tf.Qwen3Config(**small, num_key_value_heads=2, head_dim=16, tie_word_embeddings=name == "qwen3")
        return tf.Qwen3ForCausalLM(config)
    if name == "llama-bias":
        config = tf.LlamaConfig(**small, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)
        return tf.LlamaForCausalLM(config)
    moe = dict(num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False)
    if name == "phi3":  # fused qkv_proj and gate_up_proj (HF's plan: colwise_gather_output)
        return tf.Phi3ForCausalLM(tf.Phi3Config(**small, num_key_value_heads=2, pad_token_id=0,
                                                tie_word_embeddings=False))
    if name == "neox":  # per-head interleaved query_key_value
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, hidden_dropout=0.0, attention_dropout=0.0,
                                                      tie_word_embeddings=False))
    if name.startswith("gemma2"):  # tied by default; logit soft-capping, scaled embeddings, sliding windows
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, num_key_value_heads=2, head_dim=16,
                                                    tie_word_embeddings=name == "gemma2"))
    if name == "qwen2-moe":  # packed gate_up_proj experts, a shared expert
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**small, **moe, num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=48))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**small, **moe, num_local_experts=4))
    if name == "qwen3-moe":  # per-head q/k norms (replicated_with_grad_allreduce) and experts
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**small, **moe, num_experts=4, moe_intermediate_size=32,
                                                        head_dim=16))
    if name == "t5":
        config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                             dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
                             pad_token_id=0)
        return tf.T5ForConditionalGeneration(config)
    import timm

    if name in ("deit", "eva02"):  # DeiT distilled (two heads; training returns their mean), EVA-02 (rotary, SwiGLU)
        model = "deit_tiny_distilled_patch16_224" if name == "deit" else "eva02_tiny_patch14_224"
        return timm.create_model(model, pretrained=False, img_size=16, patch_size=4, embed_dim=32, depth=4,
                                 num_heads=4, num_classes=LABELS)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=32,
                             depth=4, num_heads=4, num_classes=LABELS, qk_norm=True)


def user_plan(name: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "gpt2-userplan":  # torch's styles on GPT-2's Conv1D layers
        return {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(),
                "mlp.c_proj": RowwiseParallel()}
    if name == "qwen3-userplan":  # attention only
        return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}
    return {"attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel()}


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    name = name.removesuffix("-userplan")
    g = torch.Generator().manual_seed(10 + step)
    if name.startswith(("vit", "deit", "eva")):
        return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, LABELS, (BATCH,), generator=g)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    return ids, (torch.randint(0, LABELS, (BATCH,), generator=g) if name in ("bert", "roberta") else ids)


def loss_of(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, pipelined: bool) -> torch.Tensor:
    if name.startswith(("vit", "deit", "eva")):
        return model(x, target=y) if pipelined else F.cross_entropy(model(x), y)
    return model(input_ids=x, labels=y).loss


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the tensor's scale (at least 1e-3: BERT's key bias gets no gradient and
    stays at zero up to rounding noise, whatever the strategy)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-3)).item()


def state_diff(state: dict, reference: dict) -> float:
    if sorted(state) != sorted(reference):
        raise AssertionError(f"keys differ: {sorted(set(state) ^ set(reference))[:6]}")
    for k in reference:
        if state[k].shape != reference[k].shape:
            raise AssertionError(f"{k}: shape {tuple(state[k].shape)} != library's {tuple(reference[k].shape)}")
    return max((relative(state[k], reference[k]), k) for k in reference)  # (difference, the worst key)


def train(fabric: L.Fabric | None, name: str, model, optimizer, steps: range, pipelined: bool = False) -> list:
    """``steps`` optimizer steps (their batch indices); the losses. ``fabric=None``: one process."""
    losses = []
    for step in steps:
        loss = loss_of(name, model, *batch(name, step), pipelined)
        fabric.backward(loss) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def setup(fabric: L.Fabric, name: str, model) -> tuple:
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    if fabric.strategy.engine.pipeline is not None and name.startswith(("vit", "deit", "eva")):
        model.pipeline.loss_fn = F.cross_entropy  # Fabric's PP hook for a model without its own loss
    return model, optimizer


def check(fabric: L.Fabric, name: str) -> dict:
    from disttrain.parallel.checkpoint.io import full_model_state

    model = build(name)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    ref_losses = train(None, name, reference, ref_opt, range(STEPS))
    ref_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    options = fabric.strategy.engine.options
    options.tp_plan = user_plan(name) if name.endswith("-userplan") else None
    try:
        model, optimizer = setup(fabric, name, model)
    except ValueError as e:
        return {"refused": str(e)}
    pipelined = fabric.strategy.engine.pipeline is not None
    losses = train(fabric, name, model, optimizer, range(STEPS), pipelined)
    out = os.path.join(tmpdir(), name)
    fabric.strategy.export_full(model, f"{out}.safetensors")
    fabric.save(f"{out}-ckpt", {"model": model, "optimizer": optimizer})
    result = {"losses": losses, "ref_losses": ref_losses}
    # The offline readers check the folder on every rank together (a collective); rank 0 writes the export.
    result["ckpt_diff"] = state_diff(full_model_state(f"{out}-ckpt", key="model"), ref_state)
    if not name.startswith(("vit", "deit", "eva")):
        from disttrain.parallel.checkpoint.export import export_checkpoint

        export_checkpoint(f"{out}-ckpt", "hf", f"{out}-hf", key="model", config=reference.config.to_dict())
    # HF loads the exported directory as its own model
    if fabric.global_rank == 0 and not name.startswith(("vit", "deit", "eva")):
        import transformers as tf

        loaded = getattr(tf, type(reference).__name__).from_pretrained(f"{out}-hf")
        x, _ = batch(name, STEPS)
        with torch.no_grad():
            result["hf_logits_diff"] = relative(loaded(input_ids=x).logits, reference(input_ids=x).logits)
    if fabric.global_rank == 0:
        from safetensors.torch import load_file

        result["export_diff"] = state_diff(load_file(f"{out}.safetensors"), ref_state)
    # Resume into a model with other weights (and no optimizer state): the next step continues the reference run.
    fresh = build(name)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.01)
    fresh, fresh_opt = setup(fabric, name, fresh)
    fabric.load(f"{out}-ckpt", {"model": fresh, "optimizer": fresh_opt})
    result["resumed"] = train(fabric, name, fresh, fresh_opt, range(STEPS, STEPS + 1), pipelined)
    result["ref_resumed"] = train(None, name, reference, ref_opt, range(STEPS, STEPS + 1))
    fabric.barrier()
    return result


fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy_from_spec(spec, "fabric"))
fabric.launch()
write_result({name: check(fabric, name) for name in names})
