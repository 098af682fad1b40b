"""The roadmap file's schema: phases, their dependencies, and exit criteria that gates decide."""

from __future__ import annotations

from datetime import date
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kdctl.inventory.models import Duration, Name, Threshold


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Criterion(_Model):
    """One exit criterion: a gate's passing, fresh result for a backend (against a baseline),
    under given settings, with thresholds on the metrics it recorded."""

    # Unique in the roadmap; unset, `gate:backend` (`command:NAME` for a command check).
    name: Name | None = None
    gate: str
    # Unset: the roadmap's candidate.
    backend: Name | None = None
    # Unset: the roadmap's serving backend for gates that compare, none for the others.
    baseline: Name | None = None
    # Overrides of the inventory's `gates.<gate>` settings; a result run with other values
    # for these keys does not count.
    settings: dict[str, Any] = Field(default_factory=dict)
    # The command gate: which of the inventory's `gates.commands` decides this criterion.
    command: Name | None = None
    # Metric name (shell-style wildcards, e.g. '*.ratio') to threshold; every matching metric
    # of the result must hold, and at least one must exist.
    require: dict[str, Threshold] = Field(default_factory=dict)
    # Overrides how long the result counts (else `gates.freshness`, else the gate's default).
    freshness: Duration | None = None
    description: str | None = None


class Phase(_Model):
    id: Name
    title: str = Field(min_length=1)
    # The team's own word for it ("Phase 3"), shown beside the id.
    label: str | None = Field(default=None, min_length=1, max_length=40)
    depends_on: list[Name] = Field(default_factory=list)
    criteria: list[Criterion] = Field(min_length=1)
    description: str | None = None
    # How long the work is expected to take once started (a person's estimate, kept apart
    # from a forecast measured from a trend), who owns it, and the date it is due.
    estimate: Duration | None = None
    owner: str | None = Field(default=None, min_length=1, max_length=80)
    target: date | None = None


class RoadmapSpec(_Model):
    title: str = Field(min_length=1)
    # The backend that takes traffic today, and the one the roadmap leads to.
    serving: Name
    candidate: Name
    # The phase whose prerequisites decide "can we cut over"; unset, the last phase.
    target: Name | None = None
    # The throughput criterion that says whether an engine is "speed-optimized"; unset, the
    # first throughput criterion that requires a ratio against the baseline. A criterion's
    # name as `kdctl phases` shows it (`gate:backend` where it has no `name`).
    speed: str | None = None
    phases: list[Phase] = Field(min_length=1)
