"""kdctl's load generator: streamed requests at a fixed concurrency or on Poisson arrivals,
measured as `vllm bench serve` measures them, through each backend's own protocol."""

from kdctl.loadgen._clients import (
    CLIENTS,
    LineSplitter,
    RequestFailed,
    StreamClient,
    client_class,
)
from kdctl.loadgen._runner import LoadPlan, Progress, arrival_offsets, run_load
from kdctl.loadgen._stats import (
    SLO,
    BenchMetrics,
    RequestRecord,
    Stats,
    histogram_quantile,
    past_last_bucket,
    percentile,
    resolution,
)

__all__ = [
    "CLIENTS",
    "SLO",
    "BenchMetrics",
    "LineSplitter",
    "LoadPlan",
    "Progress",
    "RequestFailed",
    "RequestRecord",
    "Stats",
    "StreamClient",
    "arrival_offsets",
    "client_class",
    "histogram_quantile",
    "past_last_bucket",
    "percentile",
    "resolution",
    "run_load",
]
