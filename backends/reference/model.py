"""Tiny models made here, from a fixed seed, with no download: the exactness oracle's subjects.

`deepseek_v3` is Kimi K2's architecture (MLA attention, routed and shared experts); `llama` is
what vLLM's CPU build loads. A short training run on local text makes the next-token
distributions peaked like a real model's: with random weights every position is a near-tie and
an exactness gate would prove nothing.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kdctl.backends.reference import require_extra
from kdctl.errors import InputError

Arch = Literal["deepseek_v3", "llama"]
VOCAB_SIZE = 2048
SEED = 0
# Fixed modules of the running interpreter's standard library: local text with structure to
# learn. The model is a function of these bytes, so it can differ between Python versions.
CORPUS_MODULES = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "shlex.py",
    "textwrap.py",
    "string.py",
    "csv.py",
    "heapq.py",
    "bisect.py",
    "json/encoder.py",
    "json/decoder.py",
    "enum.py",
)
QUANTIZATION_KEY = "kdctl_quantization"

# A deepseek_v3 sized to take real GPU time (about 1.5B parameters, 7 MoE layers of 64 routed
# experts, top-8, and one shared): pass it as `config_overrides` with `device="cuda"`, and
# LARGE_TRAINING's step, smaller than the tiny model's and clipped: 200 steps of it on an H200
# took 56 s and reached loss 3.27 (docs/gpu-validation.md).
LARGE_DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
LARGE_TRAINING: dict[str, Any] = {"lr": 5e-4, "grad_clip": 1.0}
# Kimi K2's rope_scaling, its context scaled down to the tiny model's: the same factor, beta
# and mscale, 64 original positions for K2's 4,096.
K2_YARN: dict[str, Any] = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
Size = Literal["tiny", "large"]
# make_model's keyword arguments for each size the CLI offers (`make-model --size`).
SIZES: dict[Size, dict[str, Any]] = {
    "tiny": {},
    "large": {"config_overrides": LARGE_DEEPSEEK_V3, **LARGE_TRAINING},
}


@dataclass(frozen=True)
class ModelReport:
    out: Path
    arch: str
    parameters: int
    train_steps: int
    final_loss: float | None
    quantization: dict[str, Any] | None

    def document(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "arch": self.arch,
            "parameters": self.parameters,
            "train_steps": self.train_steps,
            "final_loss": self.final_loss,
            "quantization": self.quantization,
        }

    def describe(self) -> str:
        q = self.quantization
        quant = f", {q['method']} g{q.get('group_size', '?')}" if q else ""
        return (
            f"{self.arch} model with {self.parameters:,} parameters{quant} written to "
            f"{self.out} (trained {self.train_steps} steps, loss {self.final_loss})"
        )


def corpus_text() -> str:
    stdlib = Path(sys.modules["os"].__file__ or "").parent
    parts = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8"))
    if not parts:
        raise InputError(f"no standard-library sources found under {stdlib} to train on")
    return "\n".join(parts)


def _config(arch: Arch, overrides: Mapping[str, Any] | None = None) -> Any:
    """The architecture's tiny config, with `overrides` applied before the config derives its
    own fields (DeepseekV3Config's qk_head_dim, say); an unknown field is an input error."""
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config as cls

        fields: dict[str, Any] = dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            # Kimi K2's own routing (moonshotai/Kimi-K2-Instruct's config.json): sigmoid
            # scores with a correction bias picking the top experts (noaux_tc), one group,
            # their weights normalised and scaled by 2.827; every layer past the first MoE.
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            moe_layer_freq=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            # And its positions: YaRN, as K2 stretches 4,096 positions 32 times to 131,072,
            # here 64 to the tiny model's 2,048, which scales attention by YaRN's mscale
            # squared (0.1 ln 32 + 1)^2 = 1.81 as K2's does.
            rope_theta=50000.0,
            rope_scaling=dict(K2_YARN),
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            # Room for the shipped corpus's long prompts (up to 1,400 of these tokens).
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
        )
    elif arch == "llama":
        from transformers import LlamaConfig as cls

        fields = dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
        )
    else:
        raise InputError(f"--arch: unknown architecture {arch!r} (known: deepseek_v3, llama)")
    if overrides:
        known = set(cls().to_dict())
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InputError(f"{arch} config has no field {', '.join(map(repr, unknown))}")
        fields.update(overrides)
    return cls(**fields)


def parse_config_settings(items: Sequence[str]) -> dict[str, Any]:
    """`FIELD=VALUE` items (make-model's `--set`) as config overrides: a value is read as JSON
    where it is JSON (512, 1e-5, true), else kept as text; whether the field exists is the
    config's to say (`_config`)."""
    settings: dict[str, Any] = {}
    for item in items:
        field, sep, raw = item.partition("=")
        if not sep or not field.isidentifier():
            raise InputError(f"--set: {item!r} is not FIELD=VALUE")
        try:
            settings[field] = json.loads(raw)
        except ValueError:
            settings[field] = raw
    return settings


# A plain transcript: every engine that serves chat (SGLang, vLLM, the reference server) needs
# the tokenizer's template, and refuses chat without one.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def _tokenizer(text: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        bos_token="<s>",  # noqa: S106 - special tokens, not secrets
        eos_token="</s>",  # noqa: S106
        pad_token="<pad>",  # noqa: S106
    )


def quantize_w4a16(model: Any, group_size: int) -> dict[str, Any]:
    """Symmetric per-group INT4 on every expert and MLP weight, then back to float.

    The candidate serves these dequantized weights, so a kernel that implements W4A16
    correctly should match it token for token; the router and attention stay full precision.
    """
    import torch

    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." not in name or param.dim() < 2 or name.endswith("mlp.gate.weight"):
                continue
            *lead, cols = param.shape
            if cols % group_size:
                raise InputError(
                    f"--group-size {group_size} does not divide {name}'s {cols} input columns"
                )
            w = param.data.reshape(*lead, cols // group_size, group_size)
            scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 7.0
            q = torch.clamp(torch.round(w / scale), -8, 7)
            param.data.copy_((q * scale).reshape(param.shape))
            names.append(name)
    return {
        "method": "w4a16",
        "bits": 4,
        "group_size": group_size,
        "symmetric": True,
        "weights": names,
    }


def make_sized_model(
    arch: Arch,
    out: Path,
    *,
    size: Size = "tiny",
    settings: Sequence[str] = (),
    device: str = "cpu",
    **kwargs: Any,
) -> ModelReport:
    """`make-model`: a size's config and training step, with `FIELD=VALUE` settings over them."""
    if size != "tiny" and arch != "deepseek_v3":
        raise InputError(f"--size {size} is a deepseek_v3 config; --arch is {arch}")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InputError(f"--device: {device!r} is not cpu, cuda or cuda:N")
    sized = dict(SIZES[size])
    overrides = {**sized.pop("config_overrides", {}), **parse_config_settings(settings)}
    return make_model(
        arch, out, device=device, config_overrides=overrides or None, **sized, **kwargs
    )


def make_model(
    arch: Arch,
    out: Path,
    *,
    train_steps: int = 300,
    quantize: Literal["w4a16"] | None = None,
    group_size: int = 32,
    from_model: Path | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    device: str = "cpu",
    lr: float = 3e-3,
    grad_clip: float | None = None,
) -> ModelReport:
    """Write a tiny model and its tokenizer to `out`; the same arguments give the same bytes.

    `config_overrides` changes the architecture's config (a larger model: LARGE_DEEPSEEK_V3);
    `device` is where the weights are made and trained (saved from there as fp32). Nothing
    promises bitwise-repeatable training on CUDA (two runs on an H200 did reach the same loss),
    so "the same bytes" is the CPU's guarantee.
    """
    require_extra("torch", "transformers", "tokenizers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Its load and save bars would bury the sandbox's own output.
    hf_logging.disable_progress_bar()

    if train_steps < 0:
        raise InputError("--train-steps must be >= 0")
    if group_size < 1:
        raise InputError("--group-size must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reduction order, the same bits, every time
    try:
        torch.manual_seed(SEED)
        if from_model is not None:
            model = AutoModelForCausalLM.from_pretrained(from_model, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(from_model)
            loss = None
            steps = 0
        else:
            text = corpus_text()
            tokenizer = _tokenizer(text)
            config = _config(arch, config_overrides)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            loss = _train(
                model, tokenizer(text)["input_ids"], train_steps, lr=lr, grad_clip=grad_clip
            )
            if loss is not None and not math.isfinite(loss):
                raise InputError(f"training diverged (loss {loss}): lower the learning rate")
            steps = train_steps
        quant = quantize_w4a16(model, group_size) if quantize == "w4a16" else None
        if quant is not None:
            model.config.update({QUANTIZATION_KEY: quant})
        extra = {"trained_on": device, "lr": lr} if device != "cpu" else {}
        _save(model, tokenizer, out, arch, steps, loss, quant, config_overrides, **extra)
        params = sum(p.numel() for p in model.parameters())
    finally:
        torch.set_num_threads(threads)
    return ModelReport(out, arch, params, steps, loss, quant)


def _save(
    model: Any,
    tokenizer: Any,
    out: Path,
    arch: Arch,
    steps: int,
    loss: float | None,
    quant: dict[str, Any] | None,
    config_overrides: Mapping[str, Any] | None,
    **extra: Any,
) -> None:
    model.generation_config.do_sample = False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _k2_fields(out / "config.json")
    meta = {
        "arch": arch,
        "seed": SEED,
        "train_steps": steps,
        "final_loss": loss,
        "quantization": quant,
        **({"config_overrides": dict(config_overrides)} if config_overrides else {}),
        **extra,
    }
    (out / "kdctl-model.json").write_text(json.dumps(meta, indent=2) + "\n")


def _k2_fields(path: Path) -> None:
    """K2's own names for its positions beside transformers 5's: it writes `rope_parameters`
    only, and an engine reading a K2 config (SGLang's DeepSeek model) looks for `rope_theta`
    and `rope_scaling`."""
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "yarn" or config.get("rope_scaling"):
        return
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = {
        k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")
    } | {"type": "yarn"}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _train(
    model: Any, ids: list[int], steps: int, *, lr: float = 3e-3, grad_clip: float | None = None
) -> float | None:
    import torch

    if steps == 0:
        return None
    device = next(model.parameters()).device
    data = torch.tensor(ids, dtype=torch.long)
    seq, batch = 64, 16
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()]).to(device)
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        loss_value = float(out.loss.detach())
    model.eval()
    return round(loss_value, 4)
