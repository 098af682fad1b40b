"""The native engine's command contract: one JSON request file in, one JSON response file out.

docs/native-engine-contract.md is the human-readable version of what this module enforces;
kdctl's side (the native backend in command mode) and a reference implementation
(`kdctl reference batch`) both use these models, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kdctl.backends._types import EngineInfo, FinishReason, GenerateRequest, TokenLogprob

CONTRACT_VERSION: Literal[1] = 1

EXIT_OK = 0  # the response file is written; individual requests may still carry an error
EXIT_BAD_REQUEST = 2  # the request file is unreadable or invalid; no response file
EXIT_ENGINE_FAILURE = 3  # the engine could not run (model missing, out of memory, ...)


class ContractRequest(GenerateRequest):
    model_config = ConfigDict(extra="forbid")
    id: str


class RequestFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    contract: Literal[1] = CONTRACT_VERSION
    requests: list[ContractRequest] = Field(default_factory=list)
    # At most this many requests generating at once, admitted in file order, the next as one
    # finishes: what a server does under that many clients. kdctl sets it when it measures
    # speed; unset, the engine batches as it likes.
    batch_size: int | None = Field(default=None, ge=1)


class ContractError(BaseModel):
    type: str
    message: str


class ContractTimings(BaseModel):
    """The engine's own clock around one request of its generation loop, in seconds: the
    weights' load and the files' reading and writing are outside it."""

    # When the engine admitted this request into the batch, after the run's first admission.
    start_s: float = Field(ge=0)
    # From admission to the first output token: the prefill, and any wait for a turn.
    ttft_s: float = Field(ge=0)
    # From the first output token to the last.
    decode_s: float = Field(ge=0)
    # Forward passes after the first token: one per token, or a speculative decoder's
    # verification passes.
    decode_steps: int = Field(ge=0)


class ContractResult(BaseModel):
    id: str
    output_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    # Verification passes of a speculative decoder, as SGLang's meta_info.spec_verify_ct;
    # absent when the engine does not decode speculatively.
    spec_verify_ct: int | None = None
    # Absent from an engine that does not time itself (one older than the field): its speed
    # then cannot be measured before it serves.
    timings: ContractTimings | None = None
    error: ContractError | None = None


class ResponseFile(BaseModel):
    contract: Literal[1] = CONTRACT_VERSION
    engine: EngineInfo
    results: list[ContractResult] = Field(default_factory=list)
