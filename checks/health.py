"""health: the engine is alive, generates one token, and is the model the inventory names."""

from __future__ import annotations

from datetime import timedelta

from kdctl.backends import GenerateRequest
from kdctl.checks._base import Gate, GateContext
from kdctl.errors import KdctlError
from kdctl.records import GateResult, Metric, Verdict, decide, utcnow


class HealthGate(Gate):
    name = "health"
    freshness_window = timedelta(minutes=15)
    description = "liveness, a one-token generation, model identity"

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        spec = ctx.inventory.backends[backend]
        reasons: list[str] = []
        findings: list[str] = []
        metrics: list[Metric] = []
        info = None
        verdict: Verdict = "pass"
        try:
            with ctx.backend(backend) as be:
                health = be.health()
                metrics.append(Metric(name="health_latency_ms", value=health.latency_ms, unit="ms"))
                if health.state != "up":
                    findings.append(f"health is {health.state}: {health.detail}")
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
                    # Ids only where the API returns them (SGLang's OpenAI routes do not): the
                    # server's own count is the measure, the ids a cross-check.
                    ids = len(one.output_ids) if one.output_ids else one.completion_tokens
                    if one.completion_tokens != 1 or ids != 1:
                        findings.append(
                            f"a one-token generation returned {one.completion_tokens} tokens"
                            + (f" ({len(one.output_ids)} ids)" if one.output_ids else "")
                        )
                    if spec.model:
                        # An engine that does not name its model has not shown it serves ours.
                        same = None if not info.model else int(info.model == spec.model)
                        metrics.append(
                            Metric(name="model_matches", value=same, threshold=1, comparison="==")
                        )
                        if same == 0:
                            findings.append(f"serves {info.model}, the inventory says {spec.model}")
                        elif same is None:
                            reasons.append(
                                f"the engine does not say which model it serves; the inventory "
                                f"says {spec.model}"
                            )
        except KdctlError as exc:
            verdict = "error"
            reasons.append(str(exc))
        if verdict != "error":
            verdict = decide(metrics, findings)
        if verdict == "pass" and info is not None:
            reasons.append(f"up, generates, serves {info.model or 'an unnamed model'}")
        return self.result(
            ctx,
            backend,
            started=started,
            verdict=verdict,
            metrics=metrics,
            reasons=findings + reasons,
            info=info,
        )
