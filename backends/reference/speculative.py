"""Speculative decoding on the reference engine: a draft model proposes, the target verifies.

The draft, a smaller model of the same tokenizer, proposes `draft_tokens` tokens greedily from
its own KV cache; the target scores the last accepted token and every proposal in one forward
pass, keeps the longest run of proposals it would have chosen itself, and adds its own next
token. Greedy output is therefore the target's own, token for token, by construction; what
speculation changes is how many target passes it takes, reported as SGLang reports its own
(`spec_verify_ct`, one per verification pass). The proposals form a chain: a draft tree of
width one.

Sampled requests (temperature > 0) decode plainly on the target and report no verification.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kdctl.backends._types import GenerateRequest, GenerateResult, TokenLogprob
from kdctl.backends.reference.engine import ReferenceEngine, token_logprob
from kdctl.backends.reference.model import QUANTIZATION_KEY
from kdctl.errors import InputError


def reference_settings(
    model_dir: Path,
    draft: Path | None,
    draft_tokens: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """How the engine `open_engine` makes runs, under SGLang's names for the same settings:
    what the reference server's /server_info and its command contract report."""
    try:
        quantization = json.loads((model_dir / "config.json").read_text()).get(QUANTIZATION_KEY)
    except (OSError, json.JSONDecodeError):
        quantization = None
    return {
        "tp_size": 1,
        "dp_size": 1,
        "device": device,
        "dtype": dtype,
        "quantization": quantization,
        # SGLang's names for a separate draft model's speculative decoding.
        "speculative_algorithm": "STANDALONE" if draft else None,
        "speculative_draft_model_path": str(draft) if draft else None,
        "speculative_num_draft_tokens": draft_tokens if draft else None,
    }


def open_engine(
    model_dir: Path,
    draft: Path | None = None,
    *,
    draft_tokens: int = 4,
    device: str = "cpu",
    dtype: str = "float32",
) -> ReferenceEngine:
    """The reference engine on `model_dir`, decoding speculatively when given a `draft`."""
    if draft is None:
        return ReferenceEngine(model_dir, device=device, dtype=dtype)
    return SpeculativeEngine(
        model_dir, draft, draft_tokens=draft_tokens, device=device, dtype=dtype
    )


class SpeculativeEngine(ReferenceEngine):
    def __init__(
        self,
        model_dir: Path,
        draft_dir: Path,
        *,
        draft_tokens: int = 4,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        if draft_tokens < 1:
            raise InputError(f"--draft-tokens must be >= 1, not {draft_tokens}")
        super().__init__(model_dir, device=device, dtype=dtype)
        self.draft = ReferenceEngine(draft_dir, device=device, dtype=dtype)
        # Proposals are token ids: they mean the same only under the same vocabulary.
        if self.draft.tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise InputError(
                f"--draft-model {draft_dir}: its tokenizer is not {model_dir}'s; a draft must "
                "share the target's vocabulary"
            )
        self.draft_tokens = draft_tokens

    def steps(self, req: GenerateRequest) -> Iterator[tuple[GenerateResult, bool]]:
        """Yield the cumulative result after the prefill and after every verification pass
        (which may add several tokens at once, as SGLang's stream does), and whether it is the
        last."""
        if req.temperature != 0:
            yield from super().steps(req)
            return
        import torch

        prompt = self.prompt_of(req)
        stops = self.stops_of(req)
        out: list[int] = []
        lps: list[TokenLogprob] = []
        with self.lock, torch.inference_mode():
            logits, past = self.forward(torch.tensor([prompt], device=self.device), None)
            token = int(torch.argmax(logits[-1]))
            lps.append(token_logprob(logits[-1], token, req.top_logprobs))
        out.append(token)
        result, finish = self.result(prompt, out, lps, req, stops, spec_verify_ct=0)
        yield result, finish
        draft_past: Any = None
        drafted = 0  # tokens of prompt + out in the draft's cache
        verified = 0
        while not finish:
            seq = prompt + out
            fed = len(seq) - 1  # the target's cache holds all but the newest token
            k = min(self.draft_tokens, req.max_new_tokens - len(out) - 1)
            with self.lock, torch.inference_mode():
                proposals, draft_past, drafted = self._propose(seq, draft_past, drafted, k)
                ids = torch.tensor([[seq[-1], *proposals]], device=self.device)
                logits, past = self.forward(ids, past)
                choice = torch.argmax(logits, dim=-1).tolist()
                n = 0
                while n < len(proposals) and proposals[n] == choice[n]:
                    n += 1
                new = [*proposals[:n], int(choice[n])]
                new_lps = [token_logprob(logits[i], t, req.top_logprobs) for i, t in enumerate(new)]
                # Both caches keep only what the target accepted: the last accepted token and
                # the proposals before the first one it turned down.
                _keep(past, fed + 1 + n)
                if drafted > fed + 1 + n:
                    _keep(draft_past, fed + 1 + n)
                    drafted = fed + 1 + n
            verified += 1
            for t, lp in zip(new, new_lps, strict=True):
                out.append(t)
                lps.append(lp)
                result, finish = self.result(prompt, out, lps, req, stops, spec_verify_ct=verified)
                if finish:
                    break
            yield result, finish

    def _propose(
        self, seq: list[int], past: Any, drafted: int, k: int
    ) -> tuple[list[int], Any, int]:
        """`k` greedy proposals from the draft after `seq`, feeding it what its cache lacks."""
        import torch

        proposals: list[int] = []
        pending = seq[drafted:]
        for _ in range(k):
            ids = torch.tensor([pending], device=self.device)
            logits, past = self.draft.forward(ids, past)
            drafted += len(pending)
            proposal = int(torch.argmax(logits[-1]))
            proposals.append(proposal)
            pending = [proposal]
        return proposals, past, drafted


def _keep(cache: Any, length: int) -> None:
    """Cut a KV cache back to its first `length` positions. A negative count of positions to
    remove is what every transformers release reads alike (5.x refuses an absolute length)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
