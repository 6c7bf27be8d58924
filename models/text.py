"""Text in, text out: a checkpoint's tokenizer and chat template as transformers uses them, and
`generate_text`, which runs `generate` on strings or chat messages and returns text, optionally
streamed piece by piece from the same continuous-batching loop.

    tokenizer = models.TextTokenizer.from_pretrained("path/to/checkpoint")   # or "org/name" in the HF cache
    out = models.generate_text(model, tokenizer, ["The arena", [{"role": "user", "content": "Hi!"}]], 32,
                               on_text=lambda i, piece: print(piece, end=""))
    out.texts, out.tokens_per_second, out.compile_seconds

What transformers does, and so this:
- a prompt string is encoded with the tokenizer's special tokens (`add_special_tokens=True`: a
  Llama's BOS); a conversation (a list of {"role", "content"} dicts) is rendered by the
  checkpoint's chat template (`chat_template.jinja`, else tokenizer_config.json's
  `chat_template`), with the generation prompt, the special tokens (`bos_token`, ...) and
  `raise_exception` / `strftime_now` / a non-escaping `tojson` in scope, in jinja2's sandbox
  with `trim_blocks` and `lstrip_blocks`, then encoded without adding special tokens (the
  template wrote them);
- `decode` is the tokenizers library's, `skip_special_tokens` off unless asked, with
  transformers' clean-up of spaces where the tokenizer config asks for it (never for BPE);
- the texts `generate_text` returns are decoded skipping special tokens (a stop token ends a
  text, it is not printed).
"""
from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any, Callable, Sequence

from arena_jax.models.generate import Generation, generate
from arena_jax.models.hub import checkpoint_dir

__all__ = ["TextTokenizer", "TextGeneration", "generate_text", "TextStream"]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip  transformers' clean_up_tokenization


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a valid JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` with the chat template and special tokens of its checkpoint."""

    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None = None
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ... -> text
    clean_up_spaces: bool = False  # transformers' clean_up_tokenization_spaces, as it applies it

    @classmethod
    def from_pretrained(cls, model_dir: str) -> TextTokenizer:
        """From a checkpoint folder, or an "org/name" in the local Hugging Face cache: tokenizer.json
        (required), tokenizer_config.json and chat_template.jinja (optional)."""
        from arena_jax.models.loading import load_tokenizer

        model_dir = checkpoint_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (text in and out needs the checkpoint's tokenizer)")
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the one named "default"
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        jinja_file = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_file):  # transformers: the file wins over the config's entry
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{model_dir}/tokenizer_config.json: chat_template must be a string, got {type(template).__name__}")
        special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        model_kind = json.loads(tokenizer.to_str()).get("model", {}).get("type")
        clean = bool(config.get("clean_up_tokenization_spaces", False)) and (
            model_kind != "BPE" or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        return cls(tokenizer, template, special, clean)

    @classmethod
    def wrap(cls, tokenizer) -> TextTokenizer:
        """A TextTokenizer as given, or a bare `tokenizers.Tokenizer` (no chat template) made one."""
        if isinstance(tokenizer, cls):
            return tokenizer
        if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise ValueError(f"tokenizer must be a models.TextTokenizer or a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        return cls(tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text = self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for old, new in _CLEAN_UPS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:
        """A conversation rendered by the checkpoint's template (then encoded, unless `tokenize=False`).
        `kwargs` reach the template, over the special tokens (as in transformers)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja): give the prompt as a string")
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # transformers drops None values
        text = _compiled(self.chat_template).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def prompt_ids(self, prompt) -> list[int]:
        """A string (encoded with special tokens) or a conversation (the chat template) as token ids."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return self.apply_chat_template(prompt)
        raise ValueError(f"a prompt must be a str or a list of chat messages, got {type(prompt).__name__}")


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str):
    """The template compiled as transformers compiles chat templates (jinja2's immutable sandbox)."""
    if template not in _TEMPLATES:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]


class TextStream:
    """Token ids in, new text out, for one sequence: `push(token)` returns the text the token
    completes (possibly "", while a multi-byte character or a word piece is incomplete). The
    pieces concatenate to `decode(all ids)` (`finish()` returns what is left). The decode window
    starts a few tokens back, so tokenizers that drop a leading space at the start of a decode
    still give the space."""

    def __init__(self, tokenizer: TextTokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""
        self._prefix = self._read = 0  # ids[prefix:read] decoded to the text already emitted from the window

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.emitted += piece
        return piece

    def finish(self) -> str:
        """The rest of the text (the whole decode, less what was emitted)."""
        full = self._decode(self.ids)
        rest = full[len(self.emitted):] if full.startswith(self.emitted) else ""
        self.emitted += rest
        return rest


@dataclasses.dataclass(frozen=True)
class TextGeneration:
    """What `generate_text` returns: the texts, and the token-level `Generation` beneath them."""

    texts: list[str]  # per prompt, in prompt order: the generated text (special tokens skipped)
    prompt_tokens: list[list[int]]  # per prompt: the token ids it was encoded to
    generation: Generation

    @property
    def tokens(self) -> list[list[int]]:
        return self.generation.tokens

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second, compile time left out (`compile_seconds`)."""
        return self.generation.tokens_per_second

    @property
    def compile_seconds(self) -> float:
        return self.generation.compile_seconds

    @property
    def seconds(self) -> float:
        return self.generation.seconds


def generate_text(model, tokenizer, prompts, max_new_tokens: int, *,
                  on_text: Callable[[int, str], None] | None = None, **options) -> TextGeneration:
    """`generate` on text: each prompt a string or a chat conversation (a list of {"role",
    "content"} dicts, rendered by the checkpoint's chat template); returns the generated texts.
    A single prompt (a string, or one conversation) is a batch of one.

    `tokenizer`: a `TextTokenizer` (`TextTokenizer.from_pretrained(model_dir)`) or a bare
    `tokenizers.Tokenizer` (no chat template). `on_text(i, piece)` streams: called in the
    continuous-batching loop with each new piece of prompt i's text as its tokens come back
    (the pieces of a prompt concatenate to its text). Every other keyword is `generate`'s
    (`sampling=`, `serving=`, `temperature=`, `batch_size=`, ...; `on_token` too).
    """
    tokenizer = TextTokenizer.wrap(tokenizer)
    if on_text is not None and not callable(on_text):
        raise ValueError(f"on_text must be a callable (prompt index, text), got {type(on_text).__name__}")
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings or chat conversations")
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(tokenizer.prompt_ids(prompt))
        except ValueError as exc:
            raise ValueError(f"prompts[{i}]: {exc}") from None
        if not ids[-1]:
            raise ValueError(f"prompts[{i}] encodes to no token")
    streams = [TextStream(tokenizer) for _ in prompts]
    user_on_token = options.pop("on_token", None)

    def on_token(i: int, token: int) -> None:
        if user_on_token is not None:
            user_on_token(i, token)
        if on_text is not None:
            piece = streams[i].push(token)
            if piece:
                on_text(i, piece)

    result = generate(model, ids, max_new_tokens, on_token=on_token, **options)
    if on_text is not None:
        for i, stream in enumerate(streams):
            if rest := stream.finish():
                on_text(i, rest)
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in result.tokens]
    return TextGeneration(texts, ids, result)
