"""exactness: the candidate's greedy output on a prompt corpus against the baseline's golden one.

`strict`: identical token ids, for a native engine against its reference on tiny configs.
`logprob-close`: vLLM's rule for its model tests: at the first position where the tokens
differ, each side's token must be among the other's top-k logprobs, and that prompt's comparison
ends there; elsewhere a divergence fails the prompt.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from kdctl._limits import check_size, load_json
from kdctl.backends import Backend, GenerateRequest
from kdctl.checks._base import Gate, GateContext, provenance_of
from kdctl.errors import InputError, KdctlError
from kdctl.inventory import LoadedInventory, local_path
from kdctl.inventory.models import ExactnessSettings
from kdctl.records import Baseline, GateResult, Metric, content_hash, utcnow

DEFAULT_CORPUS = "sandbox.jsonl"
# A corpus of long prompts runs to megabytes; past this it is not a corpus.
MAX_CORPUS_BYTES = 64 << 20


def load_corpus(path: Path) -> list[dict[str, Any]]:
    """JSONL, one prompt a line: {"id": ..., "prompt": "text"} or {"id": ..., "input_ids": [..]}."""
    try:
        check_size(path.stat().st_size, MAX_CORPUS_BYTES, str(path))
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the corpus: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}): not a JSONL corpus") from None
    items = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = load_json(line, f"{path}:{no}", max_bytes=MAX_CORPUS_BYTES)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{no}: not JSON: {exc.msg}") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("input_ids" in item):
            raise InputError(f'{path}:{no}: needs exactly one of "prompt" or "input_ids"')
        if "input_ids" in item and not (
            isinstance(item["input_ids"], list)
            and item["input_ids"]
            and all(isinstance(t, int) and t >= 0 for t in item["input_ids"])
        ):
            raise InputError(f"{path}:{no}: input_ids must be a non-empty list of token ids")
        if "prompt" in item and not (isinstance(item["prompt"], str) and item["prompt"]):
            raise InputError(f"{path}:{no}: prompt must be a non-empty string")
        items.append(
            {
                "id": str(item.get("id", f"line-{no}")),
                **{k: item[k] for k in ("prompt", "input_ids") if k in item},
            }
        )
    if not items:
        raise InputError(f"{path}: the corpus has no prompts")
    ids = [i["id"] for i in items]
    if len(set(ids)) != len(ids):
        raise InputError(f"{path}: prompt ids are not unique")
    return items


def corpus_path(inv: LoadedInventory, settings: ExactnessSettings) -> Path:
    """The configured corpus, relative to the inventory; else the one kdctl ships."""
    return prompt_file(inv, settings.corpus, "gates.exactness.corpus")


def prompt_file(inv: LoadedInventory, configured: Path | None, field: str) -> Path:
    """A prompt file named in the inventory: relative to it, else one shipped under
    roadmap/prompts/; unset, the sandbox corpus."""
    if configured is None:
        return shipped_prompts(DEFAULT_CORPUS)
    path = local_path(configured, inv.path.parent)
    if path.exists():
        return path
    shipped = shipped_prompts(configured.name)
    if shipped.is_file():
        return shipped
    raise InputError(f"{field}: {configured} does not exist")


def shipped_prompts(name: str) -> Path:
    """A prompt file kdctl ships under roadmap/prompts/."""
    return Path(str(files("kdctl.roadmap").joinpath("prompts").joinpath(name)))


def workload_hash(corpus: list[dict[str, Any]], settings: ExactnessSettings) -> str:
    return content_hash(
        {"corpus": corpus, "max_new_tokens": settings.max_new_tokens, "top_k": settings.top_k}
    )[:16]


def generate_outputs(
    be: Backend, corpus: list[dict[str, Any]], settings: ExactnessSettings
) -> list[dict[str, Any]]:
    """Greedy outputs with top-k logprobs, the same fixed length for every prompt."""

    reqs = [
        GenerateRequest(
            text=item.get("prompt"),
            input_ids=item.get("input_ids"),
            max_new_tokens=settings.max_new_tokens,
            temperature=0.0,
            ignore_eos=True,
            top_logprobs=settings.top_k,
        )
        for item in corpus
    ]
    results = be.generate_batch(reqs, concurrency=settings.concurrency)
    return [
        {
            "id": item["id"],
            "output_ids": result.output_ids,
            "logprobs": [t.logprob for t in result.logprobs],
            "top": [[list(p) for p in t.top] for t in result.logprobs],
        }
        for item, result in zip(corpus, results, strict=True)
    ]


def compare_prompt(cand: dict[str, Any], base: dict[str, Any], mode: str) -> dict[str, Any]:
    c_ids, b_ids = cand["output_ids"], base["output_ids"]
    n = min(len(c_ids), len(b_ids))
    first = next((i for i in range(n) if c_ids[i] != b_ids[i]), None)
    if first is None and len(c_ids) != len(b_ids):
        first = n
    end = n if first is None else first
    diffs = []
    for pos in range(end):
        c_top = dict((int(t), lp) for t, lp in cand["top"][pos]) if pos < len(cand["top"]) else {}
        b_top = dict((int(t), lp) for t, lp in base["top"][pos]) if pos < len(base["top"]) else {}
        diffs += [abs(c_top[token] - b_top[token]) for token in c_top.keys() & b_top.keys()]
    out: dict[str, Any] = {
        "id": cand["id"],
        "matched_tokens": end,
        "tokens": len(b_ids),
        "first_divergence": first,
        "max_top_logprob_diff": round(max(diffs, default=0.0), 6),
        # Summed, not averaged, so the gate's mean weighs every compared logprob alike.
        "top_logprob_diffs": len(diffs),
        "top_logprob_diff_sum": sum(diffs),
    }
    if first is None:
        # Two empty outputs agree on nothing: a prompt with no token compared is no match.
        out["ok"] = end > 0
        return out
    c_tok = c_ids[first] if first < len(c_ids) else None
    b_tok = b_ids[first] if first < len(b_ids) else None
    c_top = {int(t): lp for t, lp in cand["top"][first]} if first < len(cand["top"]) else {}
    b_top = {int(t): lp for t, lp in base["top"][first]} if first < len(base["top"]) else {}
    out.update(
        candidate_token=c_tok,
        candidate_logprob=cand["logprobs"][first] if first < len(cand["logprobs"]) else None,
        baseline_token=b_tok,
        baseline_logprob=base["logprobs"][first] if first < len(base["logprobs"]) else None,
        candidate_in_baseline_top_k=c_tok in b_top,
        baseline_in_candidate_top_k=b_tok in c_top,
    )
    out["ok"] = mode == "logprob-close" and c_tok in b_top and b_tok in c_top
    return out


class ExactnessGate(Gate):
    name = "exactness"
    settings_field = "exactness"
    description = "greedy outputs on a prompt corpus against the baseline's golden outputs"
    needs_baseline = True

    def workloads(self, inv: LoadedInventory) -> frozenset[str] | None:
        settings = inv.spec.gates.exactness
        return frozenset({workload_hash(load_corpus(corpus_path(inv, settings)), settings)})

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        settings = ctx.inventory.spec.gates.exactness
        if baseline is None:
            raise InputError("the exactness gate needs --baseline: whose golden outputs to match")
        path = corpus_path(ctx.inventory, settings)
        corpus = load_corpus(path)
        workload = workload_hash(corpus, settings)
        info = None
        try:
            golden = ctx.baseline_lookup(baseline, "golden", workload)
            source = (
                f"golden outputs recorded {golden.created_at:%Y-%m-%d %H:%M}Z" if golden else ""
            )
            if golden is None and ctx.recorded_only:
                return self.unrecorded(
                    ctx,
                    backend,
                    baseline,
                    said="exactness not checked: no usable golden outputs",
                    workload=workload,
                    started=started,
                )
            if golden is None:
                with ctx.backend(baseline) as base_be:
                    base_out = generate_outputs(base_be, corpus, settings)
                source = f"live outputs of {baseline}"
            else:
                base_out = golden.payload["outputs"]
            with ctx.backend(backend) as be:
                info = be.info()
                cand_out = generate_outputs(be, corpus, settings)
        except KdctlError as exc:
            return self.errored(
                ctx, backend, baseline, exc, info=info, workload=workload, started=started
            )
        by_id = {o["id"]: o for o in base_out}
        missing = [c["id"] for c in cand_out if c["id"] not in by_id]
        if missing:
            raise InputError(f"the baseline has no output for prompts {missing[:5]}")
        compared = [compare_prompt(c, by_id[c["id"]], settings.mode) for c in cand_out]
        ok = sum(1 for c in compared if c["ok"])
        exact = sum(1 for c in compared if c["first_divergence"] is None and c["ok"])
        rate = round(ok / len(compared), 4) if compared else None
        reasons = [
            f"{settings.mode}: {ok}/{len(compared)} prompts match ({exact} token for token), "
            f"against {source}; corpus {path.name}, {settings.max_new_tokens} tokens, "
            f"top-{settings.top_k}"
        ]
        for c in compared:
            if not c["ok"] and c["first_divergence"] is None:
                reasons.append(f"prompt {c['id']}: neither side produced a token to compare")
            elif not c["ok"]:
                reasons.append(
                    f"prompt {c['id']}: first divergence at token {c['first_divergence']}: "
                    f"candidate {c.get('candidate_token')} ({_lp(c.get('candidate_logprob'))}) vs "
                    f"baseline {c.get('baseline_token')} ({_lp(c.get('baseline_logprob'))})"
                )
        metrics = [
            Metric(
                name="match_rate", value=rate, threshold=settings.min_match_rate, comparison=">="
            ),
            Metric(name="prompts", value=len(compared)),
            Metric(name="exact_prompts", value=exact),
        ]
        if compared:
            metrics += [
                Metric(
                    name="mean_matched_tokens",
                    value=round(sum(c["matched_tokens"] for c in compared) / len(compared), 2),
                ),
                Metric(
                    name="max_top_logprob_diff",
                    value=max(c["max_top_logprob_diff"] for c in compared),
                ),
            ]
            counted = sum(c["top_logprob_diffs"] for c in compared)
            if counted:
                # How far the candidate's logprobs sit from the baseline's where both chose
                # the same tokens: what a quantized engine's error shows as, build by build.
                mean = sum(c["top_logprob_diff_sum"] for c in compared) / counted
                metrics.append(Metric(name="mean_top_logprob_diff", value=round(mean, 6)))
        return self.result(
            ctx,
            backend,
            started=started,
            baseline=baseline,
            metrics=metrics,
            reasons=reasons[:20],
            info=info,
            workload=workload,
            details={"mode": settings.mode, "corpus": str(path), "prompts": compared},
        )


def _lp(value: float | None) -> str:
    return "n/a" if value is None else f"logprob {value:.3f}"


def record_golden(ctx: GateContext, backend: str) -> Baseline:
    """Golden outputs of the engine serving today, for later comparison with a candidate."""
    settings = ctx.inventory.spec.gates.exactness
    path = corpus_path(ctx.inventory, settings)
    corpus = load_corpus(path)
    workload = workload_hash(corpus, settings)
    with ctx.backend(backend) as be:
        info = be.info()
        outputs = generate_outputs(be, corpus, settings)
    return Baseline(
        backend=backend,
        kind="golden",
        workload_hash=workload,
        provenance=provenance_of(ctx, backend, info, workload),
        payload={
            "corpus": str(path),
            "max_new_tokens": settings.max_new_tokens,
            "top_k": settings.top_k,
            "outputs": outputs,
        },
    )
