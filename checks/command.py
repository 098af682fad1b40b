"""command: a program on the backend's host prints one JSON object of metrics, and thresholds
judge them. It is how the native engine's kernel benchmarks and test suites become evidence
before the engine can serve."""

from __future__ import annotations

import json
import shlex
from typing import Any

from kdctl._limits import load_json
from kdctl.checks._base import Gate, GateContext, engine_now
from kdctl.errors import InputError, KdctlError
from kdctl.inventory.models import CommandCheck
from kdctl.records import (
    Comparison,
    GateResult,
    Metric,
    Verdict,
    decide,
    is_measurement,
    utcnow,
)


def read_metrics(stdout: str) -> dict[str, Any]:
    """The last line of stdout that is a JSON object: programs may log before it. A top-level
    `metrics` object is unwrapped."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            doc = load_json(line, "the command's output", max_bytes=1 << 20)
        except json.JSONDecodeError:
            continue
        except InputError as exc:
            raise ValueError(str(exc)) from None
        if isinstance(doc, dict):
            inner = doc.get("metrics")
            return inner if isinstance(inner, dict) else doc
    raise ValueError("no JSON object on stdout")


def judge_check(
    name: str, check: CommandCheck, exit_code: int, stdout: str, stderr: str
) -> tuple[list[Metric], list[str], list[str]]:
    """Metrics named `<check>.<metric>` with their thresholds, why the check failed, and which
    thresholds it left unjudged (a metric it did not print, or printed as no number)."""
    reasons: list[str] = []
    unmeasured: list[str] = []
    if exit_code != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:])[:300]
        reasons.append(f"{name}: exited {exit_code}{': ' + tail if tail else ''}")
    try:
        found = read_metrics(stdout)
    except ValueError as exc:
        unmeasured.append(f"{name}: {exc}")
        found = {}
    metrics = []
    for metric, (op, limit) in check.parsed().items():
        value = found.get(metric)
        number = is_measurement(value)
        comparison: Comparison = op  # type: ignore[assignment]
        m = Metric(
            name=f"{name}.{metric}",
            value=value if number else None,
            threshold=limit,
            comparison=comparison,
        )
        if not number:
            got = "missing" if metric not in found else f"{json.dumps(value)}, not a finite number"
            unmeasured.append(f"{name}: metric {metric!r} is {got}: '{op} {limit:g}' not judged")
        elif m.passed is False:
            reasons.append(f"{name}: {metric} = {value} is not {op} {limit:g}")
        metrics.append(m)
    return metrics, reasons, unmeasured


class CommandGate(Gate):
    name = "command"
    asks_engine = False
    settings_field = "commands"
    description = "programs on the backend's host that print JSON metrics, judged by thresholds"

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        spec = ctx.inventory.backends[backend]
        checks = {
            n: c
            for n, c in ctx.inventory.spec.gates.commands.items()
            # A pool named there stands for each of its replicas.
            if c.backends is None
            or backend in {m for b in c.backends for m in ctx.inventory.members(b)}
        }
        metrics: list[Metric] = []
        reasons: list[str] = []
        problems: list[str] = []
        details: dict[str, Any] = {}
        verdict: Verdict = "pass"
        if not checks:
            verdict = "skipped"
            reasons.append(f"no command checks apply to {backend} (gates.commands)")
        assert ctx.transport is not None
        try:
            transport = ctx.transport(spec.host)
            for name, check in checks.items():
                argv = check.argv
                if check.workdir:
                    # cd in a shell of its own, every word quoted: the transport takes argv.
                    argv = [
                        "sh",
                        "-c",
                        f'cd {shlex.quote(check.workdir)} && exec "$@"',
                        "sh",
                        *argv,
                    ]
                ctx.report(f"command {name}", 0, 1)
                result = transport.run(argv, timeout=check.timeout_s)
                ctx.report(f"command {name}", 1, 1)
                got, why, unjudged = judge_check(
                    name, check, result.exit_code, result.stdout, result.stderr
                )
                metrics += got
                problems += why
                reasons += unjudged
                details[name] = {
                    "command": " ".join(shlex.quote(a) for a in check.argv),
                    "exit_code": result.exit_code,
                    # Each check's own verdict: a roadmap criterion names one check.
                    "verdict": decide(got, why),
                    "stdout_tail": result.stdout[-2000:],
                }
                if details[name]["verdict"] == "pass":
                    reasons.append(f"{name}: every threshold holds")
        except KdctlError as exc:
            verdict, problems = "error", [*problems, str(exc)]
        if verdict == "pass":
            verdict = decide(metrics, problems)
        info = engine_now(ctx, backend)
        if info is None and checks:
            reasons.append(
                f"{backend} did not say what it serves: this result is tied to its host and "
                "checkpoint, not to an engine build"
            )
        return self.result(
            ctx,
            backend,
            started=started,
            verdict=verdict,
            metrics=metrics,
            reasons=problems + reasons,
            details=details,
            info=info,
        )
