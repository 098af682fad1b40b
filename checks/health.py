"""health: the engine is alive, generates one token, and is the model the inventory names."""

from __future__ import annotations

from datetime import timedelta

from kdctl.backends import GenerateRequest
from kdctl.checks._gate import Gate, GateContext, provenance_of
from kdctl.checks.result import GateResult, Metric, utcnow
from kdctl.errors import KdctlError


class HealthGate(Gate):
    name = "health"
    freshness_window = timedelta(minutes=15)
    description = "liveness, a one-token generation, model identity"

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        spec = ctx.inventory.backends[backend]
        reasons: list[str] = []
        metrics: list[Metric] = []
        info = None
        verdict = "pass"
        try:
            with ctx.backend(backend) as be:
                health = be.health()
                metrics.append(Metric(name="health_latency_ms", value=health.latency_ms, unit="ms"))
                if health.state != "up":
                    verdict = "fail"
                    reasons.append(f"health is {health.state}: {health.detail}")
                else:
                    info = be.info()
                    one = be.generate(GenerateRequest(input_ids=[1], max_new_tokens=1))
                    metrics.append(
                        Metric(
                            name="one_token_completion_tokens",
                            value=one.completion_tokens,
                            threshold=1,
                            comparison="==",
                        )
                    )
                    if one.completion_tokens != 1 or len(one.output_ids) != 1:
                        verdict = "fail"
                        reasons.append(
                            f"a one-token generation returned {len(one.output_ids)} tokens"
                        )
                    if spec.model and info.model and info.model != spec.model:
                        verdict = "fail"
                        reasons.append(f"serves {info.model}, the inventory says {spec.model}")
                    if verdict == "pass":
                        reasons.append(f"up, generates, serves {info.model or 'an unnamed model'}")
        except KdctlError as exc:
            verdict = "error"
            reasons.append(str(exc))
        return GateResult(
            gate=self.name,
            backend=backend,
            baseline=None,
            verdict=verdict,
            metrics=metrics,
            reasons=reasons,
            provenance=provenance_of(ctx, backend, info, None),
            started_at=started,
            ended_at=utcnow(),
        )
