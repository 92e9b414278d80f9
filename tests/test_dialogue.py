"""The dialogue LLM trainer: assistant-only labels, packing without cross-attention, bad JSONL, config sizes, the
resumable sampler, the HF export, and 2-process runs of the recipe (Fabric) and of DialogueLM under the Trainer."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, free_port, run_dist, run_launched, run_python
from disttrain.nlp import (
    DataError,
    DialogueLM,
    ResumableSampler,
    build_datasets,
    count_parameters,
    encode_dialogue,
    encode_dialogues,
    export_hf,
    llama_config,
    load_tokenizer,
    pack,
    read_jsonl,
)
from disttrain.nlp.corpus import demo_data
from disttrain.nlp.data import IGNORE_INDEX
from disttrain.nlp.module import build_model
from disttrain.parallel.checkpoint.io import export_safetensors

TINY = ROOT / "configs/nlp/dialogue_tiny.yaml"


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("dialogue_demo")
    jsonl, tokenizer = demo_data(root)
    return root, jsonl, tokenizer


@pytest.fixture(scope="session")
def tokenizer(demo):
    return load_tokenizer(demo[2])


def test_demo_corpus_has_english_and_chinese(demo):
    dialogues, bad = read_jsonl(demo[1])
    assert bad == 0 and len(dialogues) > 2000
    text = " ".join(m["content"] for d in dialogues for m in d)
    assert "Artificial Intelligence" in text and "你好" in text
    assert all(d[0]["role"] == "user" and d[1]["role"] == "assistant" for d in dialogues)


def test_assistant_only_labels_on_a_hand_made_dialogue(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
    ids, labels = encode_dialogue(tokenizer, messages)
    assert len(ids) == len(labels)
    kept = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
    assert all(labels[t] == ids[t] for t in kept)
    runs, start = [], kept[0]  # contiguous runs of labelled positions: one per assistant turn
    for a, b in zip(kept, kept[1:] + [None]):
        if b != a + 1:
            runs.append(tokenizer.decode(ids[start:a + 1]))
            start = b
    eos = tokenizer.eos_token
    assert runs == [f"Hello! How can I help?{eos}", f"It is 4.{eos}"]
    masked = tokenizer.decode([i for i, label in zip(ids, labels) if label == IGNORE_INDEX])
    for text in ("Be brief.", "Hi there", "What is 2+2?", "<|assistant|>", "<|user|>"):
        assert text in masked


def test_a_batch_encodes_each_dialogue_as_alone_and_a_look_ahead_template_is_refused(demo, tokenizer):
    """``encode_dialogues`` renders and tokenizes a corpus in batches: each dialogue's ids and labels are what it
    gets alone, whether its last turn is the assistant's or the user's, with a system turn and several turns."""
    dialogues, _ = read_jsonl(demo[1])
    mixed = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
             *dialogues[:6], [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                              {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]]
    batch = encode_dialogues(tokenizer, mixed)
    assert batch == [encode_dialogue(tokenizer, d) for d in mixed]
    assert len({tuple(ids) for ids, _ in batch}) == len(mixed)
    assert any(label != IGNORE_INDEX for label in batch[0][1]) and batch[0][1][-1] == IGNORE_INDEX
    counting = copy.copy(tokenizer)
    counting.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render a dialogue as a growing prefix"):
        encode_dialogues(counting, mixed[:2])


def test_pack_layout(tokenizer):
    a = ([5, 6, 7], [IGNORE_INDEX, 6, 7])
    b = ([8, 9], [8, 9])  # a dialogue whose first label is set: packing must drop it (it would predict across)
    packed = pack([a, b, a], seq_len=6, pad_id=0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 0, 1, 2]]
    assert packed.labels.tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 6, 7, -100, -100, -100]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packing_keeps_dialogues_independent(demo, tokenizer, attn):
    dialogues, _ = read_jsonl(demo[1])
    examples = [encode_dialogue(tokenizer, d) for d in dialogues[:8]]
    packed = pack(examples, seq_len=256, pad_id=tokenizer.pad_token_id)
    assert len(packed) < len(examples)  # several dialogues do share a row
    torch.manual_seed(0)
    model = build_model(llama_config(TINY), attn).eval()
    with torch.no_grad():
        packed_loss = model(input_ids=packed.input_ids, labels=packed.labels, position_ids=packed.position_ids,
                            use_cache=False).loss
        total, tokens = 0.0, 0
        for ids, labels in examples:  # each dialogue alone, weighted by its loss tokens
            labels = torch.tensor([[IGNORE_INDEX] + labels[1:]])
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += model(input_ids=torch.tensor([ids]), labels=labels, use_cache=False).loss.item() * n
            tokens += n
        # Without position ids the row is one causal sequence: dialogues see each other and the loss moves.
        leaky = model(input_ids=packed.input_ids, labels=packed.labels, use_cache=False).loss
    assert packed_loss.item() == pytest.approx(total / tokens, rel=1e-5)
    assert abs(leaky.item() - total / tokens) > 1e-3


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})


@pytest.mark.parametrize("bad,why", [
    ("{not json", "Expecting property name"),
    (json.dumps({"msgs": []}), '{"messages": [...]}'),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}), "no assistant message"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}), "role 'bot'"),
    (json.dumps({"messages": [{"role": "user", "content": 3}]}), "message 0 must be"),
])
def test_bad_jsonl_is_rejected_with_file_and_line(tmp_path, bad, why):
    path = write_lines(tmp_path / "chats.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(DataError) as e:
        read_jsonl(path)
    assert f"{path}:3:" in str(e.value) and why in str(e.value) and "--skip-bad-lines" in str(e.value)
    dialogues, skipped = read_jsonl(path, skip_bad_lines=True)
    assert (len(dialogues), skipped) == (2, 1)


def test_missing_file_and_all_bad_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no usable dialogue"):
        read_jsonl(write_lines(tmp_path / "bad.jsonl", ["[]"]), skip_bad_lines=True)


@pytest.mark.slow
def test_recipe_names_the_bad_line(tmp_path, demo):
    path = write_lines(tmp_path / "chats.jsonl", [GOOD] * 3 + ["oops"])
    proc = run_python("recipes/nlp/dialogue_llm.py", "--devices", "1", "--strategy", "auto", "--data", str(path),
                      "--tokenizer", str(demo[2]), "--out", str(tmp_path / "out"), timeout=300)
    assert proc.returncode != 0
    assert f"{path}:4: bad dialogue line" in proc.stderr


def test_config_sizes_on_the_meta_device():
    assert count_parameters(llama_config(ROOT / "configs/nlp/dialogue_10b.yaml")) == pytest.approx(10e9, rel=0.05)
    assert count_parameters(llama_config(ROOT / "configs/nlp/dialogue_1b.yaml")) == pytest.approx(1.1e9, rel=0.05)
    assert count_parameters(llama_config(TINY)) < 2e6


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'hiden_size' in model:; did you mean 'hidden_size'\?"):
        llama_config({"model": {"hiden_size": 64}})
    with pytest.raises(FileNotFoundError, match="configs/nlp/dialogue_tiny.yaml"):
        DialogueLM(config=str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="exactly one"):
        DialogueLM()


def test_sampler_resumes_mid_epoch():
    data = list(range(50))
    full = ResumableSampler(data, num_replicas=2, rank=1, seed=3)
    epoch0, epoch1 = list(full), None
    full.set_epoch(1)
    epoch1 = list(full)
    assert sorted(epoch0) != epoch0 and epoch0 != epoch1  # shuffled, differently per epoch

    first = ResumableSampler(data, num_replicas=2, rank=1, seed=3)
    first.advance(10)  # ten samples trained on, then a checkpoint
    state = first.state_dict()
    resumed = ResumableSampler(data, num_replicas=2, rank=1, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # what Lightning calls on resume: the same epoch keeps the position
    assert list(resumed) == epoch0[10:]
    resumed.set_epoch(1)
    assert list(resumed) == epoch1
    assert len(resumed) == len(epoch0)  # the full epoch, as Lightning's epoch loop expects
    resumed.advance(5)
    later = ResumableSampler(data, num_replicas=2, rank=1, seed=3)
    later.load_state_dict(resumed.state_dict())  # a checkpoint in epoch 1
    later.set_epoch(0)  # Fabric's DataLoader wrapper counts from 0 after a resume: ignored
    assert list(later) == epoch1[5:]
    with pytest.raises(ValueError, match=r"resume with data.seed 3"):
        ResumableSampler(data, num_replicas=2, rank=1, seed=4).load_state_dict(state)


def test_the_sampler_resumes_on_another_number_of_ranks_with_the_same_global_batches():
    """Saved by 2 ranks after 3 steps of 4 rows each, resumed by 1 and by 4: each later global batch (what every
    rank takes next, together) holds the samples the 2 ranks would have taken; 5 ranks cannot split 12 evenly."""
    data, step = list(range(50)), 4

    def batches(replicas: int, state: dict | None, count: int) -> list[set[int]]:
        samplers = [ResumableSampler(data, num_replicas=replicas, rank=r, seed=3) for r in range(replicas)]
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(state)
        orders = [list(sampler) for sampler in samplers]
        share = step // replicas
        return [set().union(*(order[i * share:(i + 1) * share] for order in orders)) for i in range(count)]

    saved = ResumableSampler(data, num_replicas=2, rank=0, seed=3)
    saved.advance(3 * step // 2)
    unchanged = batches(2, None, 6)[3:]
    assert batches(1, saved.state_dict(), 3) == batches(4, saved.state_dict(), 3) == unchanged
    assert batches(2, saved.state_dict(), 3) == unchanged
    with pytest.raises(ValueError, match=r"saved after 12 samples of epoch 0 on 2 data-parallel rank\(s\), which 5"
                                         r" ranks cannot split evenly; resume with a number of data-parallel ranks"
                                         r" that divides 12"):
        ResumableSampler(data, num_replicas=5, rank=1, seed=3).load_state_dict(saved.state_dict())


def test_hf_export_loads_and_generates(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from disttrain.nlp import greedy_reply

    module = DialogueLM(config=TINY)
    module.configure_model()
    out = export_hf(tmp_path / "hf", lambda p: export_safetensors(module, p, prefix="model."), module.config,
                    tokenizer)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, module.model.eval()(input_ids=ids).logits, atol=1e-5)
    reloaded = AutoTokenizer.from_pretrained(str(out))
    assert reloaded.chat_template == tokenizer.chat_template
    assert isinstance(greedy_reply(loaded, reloaded, "Hello"), str)
    generated = loaded.generate(input_ids=ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert generated.shape == (1, 9)
    finetune = DialogueLM(pretrained=str(out))  # the export is also a starting point for fine-tuning
    finetune.configure_model()
    with torch.no_grad():
        assert torch.allclose(finetune.model.eval()(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-6)


def test_build_datasets_counts(tokenizer, demo):
    dialogues, _ = read_jsonl(demo[1])
    train, val, stats = build_datasets(tokenizer, dialogues[:200], seq_len=128, val_fraction=0.1, seed=0)
    assert stats["train_rows"] == len(train) and stats["val_rows"] == len(val) > 0
    row = train[0]
    assert set(row) == {"input_ids", "labels", "position_ids"} and row["input_ids"].shape == (128,)


# ---- multi-process runs ----

def recipe(strategy: str, tmp_path: Path, demo_root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = run_launched("recipes/nlp/dialogue_llm.py", "--demo-root", str(demo_root), "--out", str(tmp_path / "out"),
                        *args, strategy=strategy, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def held_out(out: str) -> tuple[float, float]:
    before = float(out.split("held-out loss before training")[1].split()[0])
    after = float(out.rsplit("held-out loss", 1)[1].split()[0])
    return before, after


@pytest.mark.slow
def test_recipe_fsdp_lowers_held_out_loss_and_exports(tmp_path, demo):
    from transformers import AutoModelForCausalLM

    proc = recipe("disttrain_fsdp", tmp_path, demo[0], "--steps", "20", "--eval-every", "10")
    out = proc.stdout
    before, after = held_out(out)
    assert after < 0.85 * before, (before, after)
    assert "held-out perplexity" in out and "tokens/s" in out and "assistant:" in out
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "hf")) is not None


@pytest.mark.slow
def test_recipe_fine_tunes_a_pretrained_folder_with_lora_under_zero3(tmp_path, demo):
    """--pretrained (a Qwen2 folder with the demo tokenizer: not the YAML's Llama) + --lora-rank: only the adapters
    train (the base is read sharded, frozen), held-out loss falls, the adapter folder is what peft loads, and the
    reply comes from base + adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = load_tokenizer(demo[2])
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, tie_word_embeddings=True))
    base.save_pretrained(tmp_path / "qwen2")
    tokenizer.save_pretrained(str(tmp_path / "qwen2"))
    proc = recipe("disttrain_zero3", tmp_path, demo[0], "--pretrained", str(tmp_path / "qwen2"), "--data", "demo",
                  "--lora-rank", "8", "--steps", "6", "--eval-every", "6", "--lr", "1e-2")
    assert "fine-tuning" in proc.stdout and "(Qwen2ForCausalLM); LoRA: " in proc.stdout, proc.stdout[-2000:]
    # the header line says what was chosen for the run: the demo data (asked for), the device's precision and the
    # model's sequence length; the learning rate was given
    header = next(line for line in proc.stdout.splitlines() if line.startswith("fine-tuning"))
    assert header.endswith("; data: the chatterbot demo dialogues (--data demo), precision 32-true (CPU; --precision),"
                           " seq len 256 (the model's longest is 256; --seq-len)"), header
    before, after = held_out(proc.stdout)
    assert after < before
    adapter = tmp_path / "out" / "adapter"
    assert sorted(p.name for p in adapter.iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen2")), str(adapter))
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())  # trained away from 0
    assert "assistant:" in proc.stdout
    bad = run_launched("recipes/nlp/dialogue_llm.py", "--demo-root", str(demo[0]), "--out", str(tmp_path / "bad"),
                       "--lora-rank", "8", strategy="disttrain_fsdp", timeout=300)
    assert "LoRA (rank 8) adapts pretrained weights: pass --pretrained DIR" in bad.stdout + bad.stderr


def recipe_module():
    """recipes/nlp/dialogue_llm.py imported (its argument handling is checked in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dialogue_llm_recipe", ROOT / "recipes/nlp/dialogue_llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrained_takes_fine_tuning_defaults_from_the_model_and_needs_data(tmp_path):
    """--pretrained without --config: precision from the device, the model's sequence length (capped), a
    fine-tuning learning rate (LoRA's higher), each only where no flag gave it; no --data is one line."""
    from transformers import LlamaConfig

    from disttrain.parallel.split.lora import LoraSettings

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=32768).save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").write_bytes(b"")  # only its presence is checked here
    dialogue_llm = recipe_module()

    def settings(*argv: str) -> dict:
        return dialogue_llm.settings(dialogue_llm.parse_args(["--pretrained", str(tmp_path / "llama"), *argv]))

    with pytest.raises(ValueError, match=r"--pretrained .*llama fine-tunes a real model on your chats: pass --data"
                                         r" CHATS.jsonl .* or --data demo to fine-tune it on the chatterbot demo"):
        settings()
    full = settings("--data", "chats.jsonl")
    assert (full["train"]["precision"], full["data"]["seq_len"], full["train"]["lr"]) == ("32-true", 4096, 2e-5)
    assert full["chosen"] == ["precision 32-true (CPU; --precision)",
                              "seq len 4096 (the model's longest is 32768, capped at 4096; --seq-len)",
                              "lr 2e-05 (full fine-tuning; --lr)"]
    lora = settings("--data", "demo", "--lora-rank", "8", "--seq-len", "512", "--precision", "bf16-true")
    assert isinstance(lora["lora"], LoraSettings) and lora["data"]["train"] is None  # the demo is built
    assert (lora["train"]["precision"], lora["data"]["seq_len"], lora["train"]["lr"]) == ("bf16-true", 512, 2e-4)
    assert lora["chosen"] == ["data: the chatterbot demo dialogues (--data demo)", "lr 0.0002 (LoRA fine-tuning; --lr)"]
    given = settings("--data", "chats.jsonl", "--config", str(ROOT / "configs/nlp/dialogue_tiny.yaml"))
    assert (given["train"]["lr"], given["data"]["seq_len"], given["chosen"]) == (3e-3, 256, [])  # the YAML's own


@pytest.mark.slow
def test_recipe_resumes_with_the_next_unseen_batch(tmp_path, demo):
    def losses(out: str) -> dict[int, float]:
        return {int(line.split()[1]): float(line.split()[-1]) for line in out.splitlines()
                if line.startswith("step") and line.split()[2:4] == ["train", "loss"] and len(line.split()) == 5}

    demo_config = ("--config", "configs/nlp/dialogue_demo.yaml")  # what `make demo` runs, as docs/recipes shows it
    # The checkpoints are written in the background (--async-checkpoint); the resume reads the one of step 3.
    full = recipe("disttrain_fsdp", tmp_path / "a", demo[0], *demo_config, "--steps", "6", "--eval-every", "100",
                  "--log-every", "1", "--save-every", "3", "--async-checkpoint")
    ckpt = tmp_path / "a" / "out" / "checkpoints" / "step-000003"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step-000003", "step-000006"]  # the last one waited for
    assert (ckpt.parent / "step-000006" / "manifest.json").is_file()
    resumed = recipe("disttrain_fsdp", tmp_path / "b", demo[0], *demo_config, "--steps", "6", "--eval-every", "100",
                     "--log-every", "1", "--resume", str(ckpt))
    assert "resumed at step 3" in resumed.stdout
    a, b = losses(full.stdout), losses(resumed.stdout)
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], abs=2e-6), (step, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["disttrain_ddp", "disttrain_zero3", "disttrain_auto"])
def test_recipe_runs_under_other_strategies(tmp_path, demo, strategy):
    proc = recipe(strategy, tmp_path, demo[0], "--steps", "4", "--eval-every", "4", "--global-batch", "32")
    if strategy == "disttrain_auto":  # the planner's pick for 1.26M parameters that fit a rank: DDP
        assert "recommendation: disttrain_ddp" in proc.stdout, proc.stdout[-3000:]
    assert "2 micro-step(s) per optimizer step" in proc.stdout  # 32 rows = 2 ranks x 8 x 2 micro-steps
    before, after = held_out(proc.stdout)
    assert after < before
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_trainer_fsdp_lowers_held_out_loss_and_resumes_mid_epoch(tmp_path, demo):
    results = run_dist("dialogue_trainer.py", tmp_path, str(demo[0]))
    r = results[0]
    assert r["after"] < 0.9 * r["before"], r
    assert results[1]["after"] == pytest.approx(r["after"])  # every rank reports the same held-out loss
    assert r["reply_is_text"]
    for rank in results:  # 12 batches of 8 rows, then 3 more after the resume, all inside epoch 0
        assert (rank["sampler_position"], rank["resumed_position"]) == (96, 120)
        assert rank["resumed_batches"] == rank["expected_batches"] and rank["first_batches_differ"]


@pytest.mark.slow
def test_recipe_context_parallel(tmp_path, demo):
    """--context-parallel-size 2: both processes train each packed row together (one data-parallel rank, so 16 rows
    are 2 micro-steps of 8), held-out loss falls, the export is the plain HF model; another strategy refuses it."""
    proc = recipe("disttrain_megatron", tmp_path, demo[0], "--context-parallel-size", "2", "--steps", "3",
                  "--eval-every", "3", "--global-batch", "16")
    assert "2 micro-step(s) per optimizer step" in proc.stdout
    before, after = held_out(proc.stdout)
    assert after < before
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()
    refused = run_launched("recipes/nlp/dialogue_llm.py", "--demo-root", str(demo[0]), "--out", str(tmp_path / "x"),
                           "--context-parallel-size", "2", strategy="disttrain_fsdp", timeout=300)
    assert refused.returncode != 0
    assert "dialogue_llm: error: --context-parallel-size 2 is an option of disttrain_megatron" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_recipe_tensor_parallel_and_activation_checkpointing_from_the_shared_flags(tmp_path, demo):
    """`python recipes/nlp/dialogue_llm.py --strategy disttrain_megatron --tensor-parallel-size 2
    --activation-checkpointing` (no launcher: the recipe starts its 2 CPU processes): the heads split over both
    processes (one data-parallel rank, so 16 rows are 2 micro-steps of 8), every decoder layer recomputed, held-out
    loss falls and the export is the plain HF model."""
    out = tmp_path / "out"
    proc = run_python("recipes/nlp/dialogue_llm.py", "--demo-root", str(demo[0]), "--out", str(out), "--strategy",
                      "disttrain_megatron", "--tensor-parallel-size", "2", "--activation-checkpointing", "--steps", "3",
                      "--eval-every", "3", "--global-batch", "16", "--no-report",
                      env={"MASTER_PORT": str(free_port())}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "MegatronStrategy on 2 x cpu" in proc.stdout and "2 micro-step(s) per optimizer step" in proc.stdout
    assert "activation checkpointing: every decoder layer recomputed in backward" in proc.stdout
    strategy = json.loads((out / "run.json").read_text())["strategy"]
    assert strategy["options"] == {"tensor_parallel_size": 2} and strategy["degrees"]["tp"] == 2
    before, after = held_out(proc.stdout)
    assert after < before
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_recipe_trains_an_moe_config_with_expert_parallelism(tmp_path, demo):
    """configs/nlp/dialogue_moe_tiny.yaml (Qwen2-MoE, the router's auxiliary loss on) with --expert-parallel-size 2:
    each process keeps half the experts, held-out loss falls, and the export is the plain HF MoE model."""
    proc = recipe("disttrain_megatron", tmp_path, demo[0], "--config", "configs/nlp/dialogue_moe_tiny.yaml",
                  "--expert-parallel-size", "2", "--steps", "3", "--eval-every", "3")
    before, after = held_out(proc.stdout)
    assert after < before
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    assert type(model).__name__ == "Qwen2MoeForCausalLM" and model.config.num_experts == 8
