"""What a gate decides: a GateResult, with the measurements behind it and where they came from."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

Verdict = Literal["pass", "fail", "inconclusive", "error", "skipped"]
Comparison = Literal[">=", "<=", ">", "<", "=="]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def is_measurement(value: Any) -> bool:
    """Only a finite number is a measurement: None, text, a bool, NaN or an infinity (what a
    benchmark prints when it divides by a time of zero) give a threshold nothing to judge."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not isinstance(value, float) or math.isfinite(value)


class Metric(BaseModel):
    """One measured value and, where it decides the verdict, its threshold."""

    model_config = ConfigDict(extra="forbid")

    name: str
    value: float | int | str | None
    unit: str | None = None
    threshold: float | int | None = None
    comparison: Comparison | None = None

    @property
    def judged(self) -> bool:
        """Whether a threshold decides on this metric."""
        return self.threshold is not None and self.comparison is not None

    @property
    def measured(self) -> bool:
        return is_measurement(self.value)

    @property
    def unmeasured(self) -> bool:
        """A threshold whose value was never measured: it holds no more than it breaks."""
        return self.judged and not self.measured

    @property
    def passed(self) -> bool | None:
        """True or False only for a measured value against its threshold; None otherwise."""
        if not self.judged or not self.measured:
            return None
        assert isinstance(self.value, int | float) and self.threshold is not None
        assert self.comparison is not None
        v, t = self.value, self.threshold
        return {
            ">=": v >= t,
            "<=": v <= t,
            ">": v > t,
            "<": v < t,
            "==": v == t,
        }[self.comparison]


def decide(
    metrics: Sequence[Metric], findings: Sequence[str] = (), unjudged: Sequence[str] = ()
) -> Verdict:
    """The verdict every gate's measurements come to: the one place a verdict is made.

    A finding or a broken threshold fails. A threshold whose value was not measured cannot pass,
    and neither can a run in which no threshold was judged at all, nor one with any reason in
    `unjudged` (the gate's own: runs of other lengths, probes not compared): all are
    inconclusive, since what was not measured may be broken. Only then does the gate pass.
    """
    if findings or any(m.passed is False for m in metrics):
        return "fail"
    if unjudged or any(m.unmeasured for m in metrics) or not any(m.passed for m in metrics):
        return "inconclusive"
    return "pass"


def not_met(m: Metric) -> str:
    """A threshold the metric's value breaks, in the words every gate uses."""
    return f"{m.name} {m.value} is not {m.comparison} {m.threshold:g}"


def not_measured(m: Metric) -> str:
    """Why a threshold went unjudged, in the words every gate uses."""
    return f"{m.name} was not measured: '{m.comparison} {m.threshold:g}' could not be judged"


class Provenance(BaseModel):
    """What was measured: evidence counts only while this still describes what is deployed."""

    model_config = ConfigDict(extra="forbid")

    engine_version: str | None = None
    model_path: str | None = None
    config_hash: str | None = None
    host: str | None = None
    gpus: list[int] = Field(default_factory=list)
    tp_size: int | None = None
    workload_hash: str | None = None
    kdctl_version: str | None = None
    # What really answered, read on its host: a fingerprint of the checkpoint files the engine
    # serves, and the host's own identity (machine id, GPU serials), not its inventory name.
    weights: str | None = None
    host_id: str | None = None
    # A command-mode engine's program as its host shows it (the file its command's first word
    # names: size, change time, inode): a binary rebuilt under the same version string differs.
    engine_binary: str | None = None
    # The same of the baseline a comparing gate measured against.
    baseline_weights: str | None = None
    baseline_host_id: str | None = None
    baseline_engine_version: str | None = None
    # How the engine was started, as it reported it (EngineInfo.settings): a digest of all its
    # settings, and by name those a reader asks about first, so that a change can be said.
    engine_settings: str | None = None
    engine_settings_named: dict[str, Any] | None = None
    baseline_engine_settings: str | None = None
    baseline_engine_settings_named: dict[str, Any] | None = None
    # How kdctl's requests reached the engine: "direct", or "ssh:HOST" through a channel of
    # HOST's SSH connection. Not identity: the same engine measured either way; but a figure
    # measured through a tunnel carries the tunnel's cost, so comparisons say which it was.
    http_path: str | None = None

    def with_settings(self, settings: dict[str, Any] | None) -> Provenance:
        if settings is None:
            return self
        named = {k: settings[k] for k in NAMED_SETTINGS if k in settings}
        return self.model_copy(
            update={
                "engine_settings": content_hash(settings)[:16],
                "engine_settings_named": named,
            }
        )

    def settings_change(self, now: Provenance, *, baseline: bool = False) -> str:
        """What changed in the engine's (or its baseline's) settings from this to `now`, by
        name where it can."""
        field = "baseline_engine_settings" if baseline else "engine_settings"
        then_named = getattr(self, f"{field}_named") or {}
        now_named = getattr(now, f"{field}_named") or {}
        changed = sorted(
            k for k in then_named.keys() | now_named.keys() if then_named.get(k) != now_named.get(k)
        )
        whose = "baseline's engine settings" if baseline else "engine settings"
        if getattr(now, field) is None:
            # Not said now: nothing is known to have changed to None.
            return f"{whose} {getattr(self, field)} -> unknown"
        if changed:
            return f"{whose}: " + "; ".join(
                f"{k} {then_named.get(k)} -> {now_named.get(k)}" for k in changed
            )
        then, shown = getattr(self, field), getattr(now, field) or "unknown"
        return f"{whose} {then} -> {shown} (an argument not named here)"

    def with_baseline(self, baseline: Provenance) -> Provenance:
        """This, with the identity of the baseline it was compared against beside it."""
        return self.model_copy(
            update={
                "baseline_weights": baseline.weights,
                "baseline_host_id": baseline.host_id,
                "baseline_engine_version": baseline.engine_version,
                "baseline_engine_settings": baseline.engine_settings,
                "baseline_engine_settings_named": baseline.engine_settings_named,
            }
        )

    def differs_from(self, other: Provenance, fields: tuple[str, ...] | None = None) -> list[str]:
        """The identity fields (of `fields`, else all) both know and disagree on, as
        "field then -> now"; and the bindings (checkpoint fingerprint, host id) `other` knows
        that this never recorded, since then nothing ties this to what `other` is."""
        names = fields or (
            "engine_version",
            "model_path",
            "weights",
            "host_id",
            "tp_size",
            "engine_settings",
            "engine_binary",
        )
        owed = {
            "weights": self.model_path is not None,
            "host_id": True,
            "engine_settings": self.engine_version is not None,
        }
        out = []
        for name in names:
            then, now = getattr(self, name), getattr(other, name)
            if now is None:
                continue
            if then is None:
                if owed.get(name, False):
                    out.append(f"{name} not recorded -> {now}")
            elif then != now:
                change = self.settings_change(other) if name == "engine_settings" else None
                out.append(change or f"{name} {then} -> {now}")
        return out

    @model_serializer(mode="wrap")
    def _bound_fields_when_known(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Results recorded before these fields existed keep their exact serialization, so
        # their digests (exports, the store) still verify.
        data = handler(self)
        for key in _BOUND:
            if data.get(key) is None:
                data.pop(key, None)
        return data


_BOUND = (
    "weights",
    "host_id",
    "engine_binary",
    "baseline_weights",
    "baseline_host_id",
    "baseline_engine_version",
    "engine_settings",
    "engine_settings_named",
    "baseline_engine_settings",
    "baseline_engine_settings_named",
    "http_path",
)
# SGLang's names for the settings asked about first: speculative decoding, precision,
# parallelism, batching, attention.
NAMED_SETTINGS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "quantization",
    "dtype",
    "kv_cache_dtype",
    "tp_size",
    "dp_size",
    "ep_size",
    "pp_size",
    "enable_dp_attention",
    "attention_backend",
    "chunked_prefill_size",
    "max_running_requests",
    "cuda_graph_max_bs",
    "cuda_graph_max_bs_decode",
    "cuda_graph_max_bs_prefill",
    "disable_cuda_graph",
    "enable_torch_compile",
    "context_length",
    "device",
    "incremental_streaming_output",
    # vLLM's, from its cache configuration (the part of its start its API reports).
    "cache_config.cache_dtype",
    "cache_config.block_size",
    "cache_config.enable_prefix_caching",
    "cache_config.gpu_memory_utilization",
)


class GateResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    gate: str
    backend: str
    baseline: str | None = None
    verdict: Verdict
    metrics: list[Metric] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)
    provenance: Provenance = Field(default_factory=Provenance)
    details: dict[str, Any] = Field(default_factory=dict)
    # The gate's settings as it ran: a criterion asking for other settings is not met by it.
    settings: dict[str, Any] = Field(default_factory=dict)
    started_at: datetime
    ended_at: datetime

    def metric(self, name: str) -> Metric | None:
        return next((m for m in self.metrics if m.name == name), None)


def content_hash(data: Any) -> str:
    """sha256 of a value's canonical JSON: the same content, the same hash, on any machine."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


BaselineKind = Literal["golden", "throughput", "api"]


class Baseline(BaseModel):
    """What the engine serving today produced, kept so a candidate can be compared with it later,
    when both cannot run at once on the same GPUs."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    backend: str
    kind: BaselineKind
    workload_hash: str
    provenance: Provenance = Field(default_factory=Provenance)
    created_at: datetime = Field(default_factory=utcnow)
    payload: dict[str, Any] = Field(default_factory=dict)
