"""The dialogue LLM trainer: chat SFT of a Llama-family model (``DialogueLM``), its data pipeline (JSONL ->
assistant-masked, packed rows; a resumable distributed sampler), the demo corpus/tokenizer and the HF export."""

from disttrain.nlp.data import (
    DataError,
    PackedDialogues,
    ResumableSampler,
    build_datasets,
    encode_dialogue,
    encode_dialogues,
    load_tokenizer,
    pack,
    read_jsonl,
)
from disttrain.nlp.datamodule import DialogueData
from disttrain.nlp.export import export_hf, greedy_reply, reply_from_export
from disttrain.nlp.module import DialogueLM, build_model, count_parameters, llama_config, read_recipe_config

__all__ = ["DataError", "DialogueData", "DialogueLM", "PackedDialogues", "ResumableSampler", "build_datasets",
           "build_model", "count_parameters", "encode_dialogue", "encode_dialogues", "export_hf", "greedy_reply",
           "llama_config", "load_tokenizer", "pack", "read_jsonl", "read_recipe_config", "reply_from_export"]
