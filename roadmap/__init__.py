"""Roadmaps: phases from the engine serving today to cutover, each with exit criteria that
readiness gates decide; their status is computed from evidence. The YAML files beside this
module are the shipped roadmaps, and prompts/ their corpora."""

from kdctl.roadmap._estimate import Estimate
from kdctl.roadmap._evaluate import (
    CriterionStatus,
    Crossing,
    Measured,
    PhaseReport,
    PhaseStatus,
    evaluate,
    evaluate_criterion,
    latest_crossing,
    pinned_settings,
    undated_why,
)
from kdctl.roadmap._load import (
    ResolvedCriterion,
    Roadmap,
    check_roadmap,
    load_roadmap,
    roadmap_path,
)
from kdctl.roadmap._model import Criterion, Phase, RoadmapSpec

__all__ = [
    "Criterion",
    "CriterionStatus",
    "Crossing",
    "Estimate",
    "Measured",
    "Phase",
    "PhaseReport",
    "PhaseStatus",
    "ResolvedCriterion",
    "Roadmap",
    "RoadmapSpec",
    "check_roadmap",
    "evaluate",
    "evaluate_criterion",
    "latest_crossing",
    "load_roadmap",
    "pinned_settings",
    "roadmap_path",
    "undated_why",
]
