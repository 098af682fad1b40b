"""The records every backend speaks: a generate request, its result, a stream chunk, info."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

FinishReason = Literal["length", "stop", "abort"]


class GenerateRequest(BaseModel):
    """One generation. `temperature == 0` is greedy; a seed makes sampling repeatable."""

    text: str | None = None
    input_ids: list[int] | None = None
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # The chosen tokens' logprobs; asked for with top_logprobs too. Off by default: in a
    # cumulative stream SGLang re-sends the whole list every event, which slows it down.
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


class TokenLogprob(BaseModel):
    """An output token's logprob and the top-k alternatives at its position, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class GenerateResult(BaseModel):
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    matched_stop: int | str | None = None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    # A speculative decoder's verification passes (SGLang's meta_info.spec_verify_ct); absent
    # from an engine that does not decode speculatively.
    spec_verify_ct: int | None = None


@dataclass(slots=True)
class StreamChunk:
    """A piece of a streamed generation with the time it arrived (time.perf_counter()).

    A plain record, not a validated model: the load generator builds one per token of every
    stream, and validation there cost more than the rest of its per-token work together. The
    parsers that build it check their input themselves.
    """

    received_at: float
    output_ids: list[int] = field(default_factory=list)  # new in this chunk
    text: str = ""  # new in this chunk
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # A speculative decoder's verification steps for the whole request (SGLang's
    # meta_info.spec_verify_ct, on its last event): tokens / steps is its accept length.
    spec_verify_ct: int | None = None


class EngineInfo(BaseModel):
    model: str | None = None
    served_name: str | None = None
    version: str | None = None
    tp_size: int | None = None
    context_length: int | None = None
    # How the engine was started, as it reports it (SGLang's server arguments, a native
    # engine's own): a result holds only while these are what they were when it was measured.
    settings: dict[str, Any] | None = None
    # The engine's own count of tokens per verification step over its lifetime, where it
    # decodes speculatively and says so (SGLang's internal_states[].avg_spec_accept_length).
    spec_accept_length: float | None = None


def count(value: object) -> int | None:
    """A token count from an engine's answer: an int, absent, or a malformed answer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a token count is not an integer: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """An engine's own running totals of speculative decoding (vLLM's
    `vllm:spec_decode_num_drafts` and `..._num_accepted_tokens` counters, and the tokens it
    generated): their presence says the engine drafts, their growth over a window what it
    accepted there."""

    drafts: float
    accepted: float
    generated: float

    def accept_length_since(self, earlier: SpecCounters) -> float | None:
        """Mean tokens per decoding step over the window: every step yields one token of its
        own plus those it accepted, so steps are tokens less accepted ones. Steps that
        drafted nothing count (n-gram drafting skips some), as they do in SGLang's output
        tokens over verification steps. None where nothing was generated in the window."""
        generated = self.generated - earlier.generated
        steps = generated - (self.accepted - earlier.accepted)
        if generated <= 0 or steps <= 0:
            return None
        return round(generated / steps, 3)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine has in hand now, from its own gauges (`Backend.load()`): requests being
    decoded, those waiting for a slot, and the share of its KV cache in use (0 to 1), each
    where it says (None: not exported, not zero)."""

    running: float
    queued: float | None
    token_usage: float | None = None

    @property
    def total(self) -> float:
        return self.running + (self.queued or 0.0)


@dataclass(frozen=True)
class EngineCounters:
    """An engine's request counter and its TTFT histogram's cumulative buckets ({le: count}),
    summed over labels (`Backend.counters()`). `requests` is None where the engine exports no
    such counter (SGLang before mid-2025): not counted is not zero."""

    requests: float | None
    ttft_buckets: dict[float, float]

    def went_back(self) -> bool:
        """Whether this window, as a difference, has a counter below zero."""
        return (self.requests is not None and self.requests < 0) or any(
            n < 0 for n in self.ttft_buckets.values()
        )

    def minus(self, before: EngineCounters) -> EngineCounters:
        """What was counted between `before` and this reading."""
        requests = None
        if self.requests is not None and before.requests is not None:
            requests = self.requests - before.requests
        return EngineCounters(
            requests=requests,
            ttft_buckets={
                le: n - before.ttft_buckets.get(le, 0.0) for le, n in self.ttft_buckets.items()
            },
        )
