"""Demo data: the dialogues of the ``chatterbot-corpus`` package (English and Chinese YAML) as chat JSONL, and a
small byte-level BPE tokenizer trained on them with ``tokenizers``. Built once into a local folder (seconds),
written atomically so concurrent or interrupted runs never see half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import yaml

LANGUAGES = ("english", "chinese")
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
DEFAULT_DEMO_ROOT = Path("data") / "dialogue"


def chatterbot_dialogues(languages: tuple[str, ...] = LANGUAGES,
                         topics: Optional[Sequence[str]] = None) -> Iterator[list[dict[str, str]]]:
    """Every conversation of the corpus as messages: turns alternate user, assistant, user, ... ``topics``: only
    those files of the corpus (``greetings``, ``humor``, ...), and of conversations opening with the same message
    only the first (one reply to learn per prompt)."""
    try:
        from chatterbot_corpus.corpus import DATA_DIRECTORY
    except ImportError as e:
        raise ImportError("the demo data comes from the chatterbot-corpus package: pip install chatterbot-corpus"
                          " (a dependency of disttrain)") from e
    for language in languages:
        if not (Path(DATA_DIRECTORY) / language).is_dir():
            raise ValueError(f"chatterbot-corpus has no language {language!r}; choose from "
                             f"{', '.join(sorted(p.name for p in Path(DATA_DIRECTORY).iterdir()))}")
    files = [path for language in languages for path in sorted((Path(DATA_DIRECTORY) / language).glob("*.yml"))]
    unknown = sorted(set(topics or ()) - {p.stem for p in files})
    if unknown:
        raise ValueError(f"data.demo_topics: chatterbot-corpus ({', '.join(languages)}) has no topic {unknown};"
                         f" choose from {', '.join(sorted({p.stem for p in files}))}")
    openings: set[str] = set()
    for path in files:
        if topics is not None and path.stem not in topics:
            continue
        for conversation in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations", []):
            # A few entries are numbers or nested lists in the YAML; keep plain text turns only.
            turns = [str(t).strip() for t in conversation if isinstance(t, (str, int, float))]
            turns = [t for t in turns if t]
            if len(turns) < 2 or (topics is not None and turns[0] in openings):
                continue
            openings.add(turns[0])
            yield [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def _write_atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False,
                                     encoding="utf-8") as f:
        write(f)
        tmp = f.name
    os.replace(tmp, path)


def write_chatterbot_jsonl(path: str | os.PathLike, languages: tuple[str, ...] = LANGUAGES,
                           topics: Optional[Sequence[str]] = None) -> int:
    """Convert the corpus (or its ``topics``) to chat JSONL at ``path``; returns the number of dialogues."""
    dialogues = list(chatterbot_dialogues(languages, topics))
    _write_atomic(Path(path), lambda f: f.writelines(
        json.dumps({"messages": d}, ensure_ascii=False) + "\n" for d in dialogues))
    return len(dialogues)


def train_tokenizer(jsonl: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int = 2048) -> Any:
    """Train a byte-level BPE tokenizer on the messages of ``jsonl``; save it (with the default chat template and
    role tokens) as a Hugging Face tokenizer folder, atomically. Returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from disttrain.nlp.data import DEFAULT_CHAT_TEMPLATE

    def texts() -> Iterator[str]:
        with open(jsonl, encoding="utf-8") as f:
            for line in f:
                for m in json.loads(line)["messages"]:
                    yield m["content"]

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS.values()) + ROLE_TOKENS
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS, additional_special_tokens=ROLE_TOKENS)
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    fast.save_pretrained(str(tmp))
    if out_dir.exists():  # another process finished first: keep its (identical) folder
        import shutil

        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out_dir)
    return fast


def demo_data(root: str | os.PathLike = DEFAULT_DEMO_ROOT, vocab_size: int = 2048,
              topics: Optional[Sequence[str]] = None) -> tuple[Path, Path]:
    """(JSONL, tokenizer folder) of the demo, built under ``root`` on first use: every dialogue of the corpus, or
    with ``topics`` those files' dialogues, one per opening message (``chatterbot-greetings-humor.jsonl``). The
    tokenizer is trained on the whole corpus either way."""
    root = Path(root)
    jsonl, tokenizer = root / "chatterbot.jsonl", root / f"tokenizer-{vocab_size}"
    if not jsonl.is_file():
        write_chatterbot_jsonl(jsonl)
    if not (tokenizer / "tokenizer.json").is_file():
        train_tokenizer(jsonl, tokenizer, vocab_size)
    if topics:
        subset = root / f"chatterbot-{'-'.join(topics)}.jsonl"
        if not subset.is_file():
            write_chatterbot_jsonl(subset, topics=topics)
        return subset, tokenizer
    return jsonl, tokenizer
