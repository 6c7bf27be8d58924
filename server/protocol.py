"""The OpenAI request bodies the server takes (pydantic: each field checked, a bad one is a 400
naming it), and `StopText`, which ends a text at a stop string."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT32_MAX = 2**31 - 1
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[Finite, Field(ge=0)] = 1.0
    top_p: Annotated[Finite, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None  # an extra field (vLLM's)
    seed: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # an extra field (vLLM's): besides eos
    ignore_eos: bool = False  # an extra field (vLLM's): do not stop at the model's eos tokens
    speculative: bool = True  # an extra field: false opts out of the server's speculative decoding (--speculative-k)
    stream: bool = False
    n: Annotated[int, Field(ge=1, le=16)] = 1  # choices: the first computes the prompt, the others share its pages
    user: str | None = None

    @model_validator(mode="after")
    def _stops(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token for the engine (0: the chosen token's only), or None: none."""
        return None


class CompletionRequest(Sampling):
    prompt: Union[str, list[Annotated[int, Field(ge=0)]]]
    echo: Literal[False] = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # each token's logprob and this many alternatives

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False  # each token's logprob ...
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # ... and this many alternatives

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class StopText:
    """Text pieces in, text out, ending at the first stop string (which is not sent): a tail that
    could begin a stop string is held back until the next piece settles it."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        rest, self.held = ("" if self.stopped else self.held), ""
        return rest
