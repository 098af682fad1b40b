"""Probes: facts read from a host through its transport. They never change anything.

Each probe is a pair: a parser of the command's text (tested against real recorded output) and
a function that runs the command on a transport and parses what came back.
"""

from kdctl.probes.gpus import (
    GpuInfo,
    GpuProbe,
    GpuProcess,
    parse_compute_apps,
    parse_query_gpu,
    probe_gpus,
)
from kdctl.probes.kernel import XidEvent, XidProbe, parse_xids, probe_xids
from kdctl.probes.reach import Reachability, probe_reachability
from kdctl.probes.services import ServiceState, probe_service

__all__ = [
    "GpuInfo",
    "GpuProbe",
    "GpuProcess",
    "Reachability",
    "ServiceState",
    "XidEvent",
    "XidProbe",
    "parse_compute_apps",
    "parse_query_gpu",
    "parse_xids",
    "probe_gpus",
    "probe_reachability",
    "probe_service",
    "probe_xids",
]
