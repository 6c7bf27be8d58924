"""Text in, text out (issue 40, item 3): `models.TextTokenizer` reads a checkpoint's tokenizer and
chat template as transformers does (compared with transformers itself where it is installed),
`TextStream`'s pieces concatenate to the decoded text, and `generate_text` runs `generate` on
strings and conversations, streams text from the same loop and reports tokens/s without compile."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from arena_jax import models
from hf_reference import require
from text_checkpoint import CHAT_TEMPLATE, CORPUS, write_tokenizer

TEMPLATES = {
    # a Llama-3-like template: bos_token in scope, a generation prompt
    "llama3": CHAT_TEMPLATE,
    # a Mistral-like one: raise_exception, loop variables, whitespace control
    "mistral": ("{{ bos_token }}{% for message in messages %}\n"
                "    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
                "        {{ raise_exception('roles must alternate user/assistant') }}\n"
                "    {% endif %}\n"
                "    {% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
                "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}\n{% endfor %}"),
    # a ChatML-like one: tojson (not HTML-escaping), namespace, loop.last
    "chatml": ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
               "<|{{ m.role }}|>{{ m.content }}{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}<|end|>"
               "{% if loop.last and add_generation_prompt %}<|assistant|>{% endif %}{% endfor %}"),
}
CHATS = [
    [{"role": "user", "content": "Hi there! <b>&</b>"}],
    [{"role": "user", "content": "What's 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Grüße, 東京?", "meta": {"k": "ü<>"}}],
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder with tokenizer.json and a tokenizer_config.json carrying the llama3 template."""
    path = tmp_path_factory.mktemp("text_ckpt")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny(checkpoint):
    tok = models.TextTokenizer.from_pretrained(str(checkpoint))
    config = dataclasses.replace(models.LlamaConfig.tiny(), vocab_size=tok.tokenizer.get_vocab_size())
    return models.init_random(config, seed=0), tok


def test_from_pretrained_reads_template_and_special_tokens(checkpoint, tmp_path):
    tok = models.TextTokenizer.from_pretrained(str(checkpoint))
    assert tok.chat_template == TEMPLATES["llama3"]
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert tok.encode("The arena")[0] == tok.tokenizer.token_to_id("<s>")  # special tokens added, as transformers does
    # chat_template.jinja wins over the config's entry; a list of named templates gives its "default"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES["chatml"])
    assert models.TextTokenizer.from_pretrained(str(tmp_path)).chat_template == TEMPLATES["chatml"]
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATES["mistral"]}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert models.TextTokenizer.from_pretrained(str(tmp_path)).chat_template == TEMPLATES["mistral"]
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        models.TextTokenizer.from_pretrained(str(tmp_path))


def test_chat_template_errors_are_named(tiny):
    model, tok = tiny
    bare = models.TextTokenizer.wrap(tok.tokenizer)
    with pytest.raises(ValueError, match=r"prompts\[1\]: this tokenizer has no chat template"):
        models.generate_text(model, bare, ["ok", [{"role": "user", "content": "hi"}]], 2)
    mistral = dataclasses.replace(tok, chat_template=TEMPLATES["mistral"])
    with pytest.raises(Exception, match="roles must alternate"):
        mistral.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="tokenizer must be"):
        models.generate_text(model, object(), ["ok"], 2)
    with pytest.raises(ValueError, match="on_text must be a callable"):
        models.generate_text(model, tok, ["ok"], 2, on_text="print")
    with pytest.raises(ValueError, match=r"prompts\[0\] encodes to no token"):
        models.generate_text(model, dataclasses.replace(tok, tokenizer=_NoSpecials(tok.tokenizer)), [""], 2)


class _NoSpecials:
    """A tokenizer that adds no special token (so "" encodes to nothing)."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=True):
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_stream_pieces_concatenate_to_the_text(tiny, seed):
    _, tok = tiny
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, tok.tokenizer.get_vocab_size(), size=60).tolist()
    for skip in (True, False):
        stream = models.TextStream(tok, skip_special_tokens=skip)
        pieces = [stream.push(t) for t in ids]
        pieces.append(stream.finish())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # no half character is printed


def test_generate_text_streams_the_texts_it_returns(tiny):
    model, tok = tiny
    prompts = ["The arena holds", [{"role": "user", "content": "Grüße aus Köln"}], "Pages"]
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    out = models.generate_text(model, tok, prompts, 12, batch_size=2, on_text=lambda i, p: pieces[i].append(p))
    ids = [tok.encode(prompts[0]), tok.apply_chat_template(prompts[1]), tok.encode(prompts[2])]
    assert out.prompt_tokens == ids
    plain = models.generate(model, ids, 12, batch_size=2)
    assert out.tokens == plain.tokens  # the same run as generate on the ids
    for i in range(3):
        assert out.texts[i] == tok.decode(plain.tokens[i], skip_special_tokens=True)
        assert "".join(pieces[i]) == out.texts[i]
    single = models.generate_text(model, tok, "The arena holds", 12, batch_size=2)  # one string: a batch of one
    assert single.texts == out.texts[:1]


def test_tokens_per_second_leaves_compile_out(tiny):
    model, tok = tiny
    config = dataclasses.replace(model.config, num_layers=1)  # a model no test compiled yet in this process
    fresh = models.init_random(config, seed=1)
    first = models.generate_text(fresh, tok, ["The arena"], 6)
    again = models.generate_text(fresh, tok, ["The arena"], 6)
    assert 0 < first.compile_seconds < first.seconds
    assert first.compile_seconds > 10 * again.compile_seconds  # the second call compiles (almost) nothing
    running = first.seconds - first.compile_seconds
    assert first.tokens_per_second == pytest.approx(first.generation.num_generated / running)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_templates_render_as_transformers_renders_them(checkpoint, tmp_path, name):
    _, transformers = require()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((checkpoint / f).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES[name])
    ours = models.TextTokenizer.from_pretrained(str(tmp_path))
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    chats = CHATS if name != "mistral" else [CHATS[0], CHATS[1][:2]]
    for chat in chats:
        for gen in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                theirs.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
                list(theirs.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False))
    for text in CORPUS[:5]:
        assert ours.encode(text) == theirs(text)["input_ids"]
        ids = ours.encode(text) + [ours.tokenizer.token_to_id("</s>")]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_arena_generate_chat_stream(tiny, checkpoint, tmp_path, capsys):
    """`arena-generate --chat --stream` on a checkpoint folder prints the text generate_text returns."""
    from arena_jax.models import cli
    from hf_folders import save_hf_folder

    model, tok = tiny
    folder = save_hf_folder(tmp_path / "ckpt", model.config.to_hf(), models.export_hf_tensors(model))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((checkpoint / name).read_bytes())
    argv = ["--model-dir", str(folder), "--chat", "--stream", "--prompt", "Grüße aus Köln", "--max-new-tokens", "6",
            "--batch", "1", "--dtype", "float32", "--no-compile-cache"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    expected = models.generate_text(model, tok, [[{"role": "user", "content": "Grüße aus Köln"}]], 6, batch_size=1)
    assert out.startswith(f"[0] {expected.texts[0]}\n") and "[1]" not in out  # one prompt: one row
    assert "s of it compiling" in out
