"""Checks: the readiness gates, each deciding pass, fail or inconclusive from measurements.

The public API: the `Gate` interface and the context it runs in, the registry (built-in gates
and those installed under the `kdctl.checks` entry-point group), and the evidence a gate
returns. A third-party gate subclasses `Gate` and registers itself under that group.
"""

from kdctl.checks._base import (
    BaselineLookup,
    Gate,
    GateContext,
    ProgressHook,
    provenance_for,
    provenance_of,
)
from kdctl.checks._registry import (
    Workloads,
    freshness_window,
    gate_class,
    gate_settings,
    gates,
    measured_otherwise,
    with_settings,
    workload_changed,
)
from kdctl.records import (
    Baseline,
    BaselineKind,
    GateResult,
    Metric,
    Provenance,
    Verdict,
    content_hash,
    decide,
    utcnow,
)

__all__ = [
    "Baseline",
    "BaselineKind",
    "BaselineLookup",
    "Gate",
    "GateContext",
    "GateResult",
    "Metric",
    "ProgressHook",
    "Provenance",
    "Verdict",
    "Workloads",
    "content_hash",
    "decide",
    "freshness_window",
    "gate_class",
    "gate_settings",
    "gates",
    "measured_otherwise",
    "provenance_for",
    "provenance_of",
    "utcnow",
    "with_settings",
    "workload_changed",
]
