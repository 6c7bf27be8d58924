"""A small Hugging Face style checkpoint with text, made here: a byte-level BPE tokenizer trained
on a built-in corpus (tokenizer.json), a tokenizer_config.json with special tokens and a chat
template, and a random Llama whose vocabulary is the tokenizer's (config.json,
model.safetensors). Every tool that reads a checkpoint folder takes it (`arena-serve`,
`transformers serve`, `models.load_pretrained`): the HTTP benchmark serves it from both, and
the tests and the documentation's blocks run on it.
"""
from __future__ import annotations

import json
from pathlib import Path

CORPUS = ["The arena holds every page.", "Pages are fixed-size blocks of tokens.", "Grüße aus Köln — 東京 🚀 ok?",
          "Hello, world! It's a test; isn't it?", "user: hi\nassistant: hello there",
          "The capital of France is Paris. Name three colours: red, green, blue."] * 20  # fmt: skip
SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
# A Llama-3-like template: bos_token in scope, a generation prompt.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ADDED_EOS = {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}  # fmt: skip  (as older tokenizer_config.json files write it)


def bpe_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def write_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE):
    """tokenizer.json and tokenizer_config.json into `path` (made if missing); returns the tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tok = bpe_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": ADDED_EOS, "tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False}  # fmt: skip
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def write_checkpoint(path: Path, seed: int = 0, **config_overrides) -> Path:
    """A whole checkpoint folder: the tokenizer above and a tiny random Llama (head_dim 32, so
    int4 arenas take it) with its vocabulary; `</s>` is its eos token."""
    from safetensors.numpy import save_file

    from arena_jax import models

    tok = write_tokenizer(path)
    config = models.LlamaConfig.tiny(vocab_size=tok.get_vocab_size(), head_dim=32, **config_overrides)
    model = models.init_random(config, seed=seed)
    hf = dict(config.to_hf(), eos_token_id=tok.token_to_id("</s>"), bos_token_id=tok.token_to_id("<s>"))
    (path / "config.json").write_text(json.dumps(hf))
    save_file(models.export_hf_tensors(model), str(path / "model.safetensors"))
    return path
