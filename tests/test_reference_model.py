"""`kdctl reference make-model`: tiny models from a fixed seed, trained, quantized."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tests.conftest import kdctl, need_module

need_module("torch", "reference")
import torch  # noqa: E402


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.suffix in (".safetensors", ".json") and p.name != "kdctl-model.json"
    }


def test_same_arguments_same_bytes(tmp_path: Path) -> None:
    for name in ("a", "b"):
        run = kdctl(
            "reference",
            "make-model",
            "--arch",
            "llama",
            "--train-steps",
            "5",
            "--out",
            str(tmp_path / name),
        )
        assert run.code == 0, run.err
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(_digest(tmp_path / "a"))


def _gaps(model_dir: Path) -> float:
    from kdctl.backends import GenerateRequest
    from kdctl.backends.reference.engine import ReferenceEngine

    engine = ReferenceEngine(model_dir)
    result = engine.generate(
        GenerateRequest(
            text="def __init__(self, ", max_new_tokens=24, top_logprobs=2, ignore_eos=True
        )
    )
    gaps = [t.top[0][1] - t.top[1][1] for t in result.logprobs]
    return sum(gaps) / len(gaps)


def test_training_makes_predictions_peaked(
    models: dict[str, Path], tmp_path: Path, report: Any
) -> None:
    run = kdctl(
        "reference",
        "make-model",
        "--arch",
        "deepseek_v3",
        "--train-steps",
        "0",
        "--out",
        str(tmp_path / "flat"),
    )
    assert run.code == 0, run.err
    flat, trained = _gaps(tmp_path / "flat"), _gaps(models["dsv3"])
    report(
        f"deepseek_v3 tiny model, mean top-1 minus top-2 logprob over 24 greedy tokens: "
        f"random weights {flat:.3f}, after training {trained:.3f}"
    )
    assert flat < 0.2 < 0.5 < trained


def test_w4a16_variant_quantizes_experts_and_mlp_only(models: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    full = load_file(str(models["dsv3"] / "model.safetensors"))
    quant = load_file(str(models["dsv3-int4"] / "model.safetensors"))
    meta = json.loads((models["dsv3-int4"] / "config.json").read_text())["kdctl_quantization"]
    assert meta["method"] == "w4a16" and meta["group_size"] == 16
    assert any("experts" in w for w in meta["weights"]) and any(
        "shared_experts" in w for w in meta["weights"]
    )
    for name, tensor in full.items():
        # The checkpoint stores experts one by one, whatever layout the model uses in memory.
        if ".mlp." in name and not name.endswith("mlp.gate.weight") and tensor.dim() >= 2:
            q = quant[name]
            assert not torch.equal(q, tensor), name
            groups = q.reshape(*q.shape[:-1], -1, 16)
            # Each group holds at most 16 levels of one scale: what INT4 can represent.
            for g in groups.reshape(-1, 16)[:50]:
                assert len(torch.unique(g)) <= 16
        else:
            assert torch.equal(quant[name], tensor), name  # router, attention, norms untouched


def test_bad_arguments_are_exit_2(tmp_path: Path) -> None:
    run = kdctl("reference", "make-model", "--arch", "gpt2", "--out", str(tmp_path / "x"))
    assert run.code == 2 and "--arch" in run.err and "Traceback" not in run.err
    run = kdctl(
        "reference",
        "make-model",
        "--arch",
        "llama",
        "--train-steps",
        "0",
        "--quantize",
        "w4a16",
        "--group-size",
        "7",
        "--out",
        str(tmp_path / "y"),
    )
    assert run.code == 2 and "--group-size 7 does not divide" in run.err
    for args, said in (
        (["--size", "huge"], "Invalid value for '--size'"),
        (["--size", "large", "--arch", "llama"], "--size large is a deepseek_v3 config"),
        (["--device", "tpu"], "--device: 'tpu' is not cpu, cuda or cuda:N"),
        (["--set", "hidden_size"], "--set: 'hidden_size' is not FIELD=VALUE"),
        (["--arch", "llama", "--set", "n_experts=4"], "llama config has no field 'n_experts'"),
    ):
        run = kdctl("reference", "make-model", *args, "--out", str(tmp_path / "z"))
        assert run.code == 2 and said in run.err and "Traceback" not in run.err, run.err
        assert not (tmp_path / "z").exists()


def test_set_changes_the_config(tmp_path: Path) -> None:
    out = tmp_path / "wider"
    run = kdctl(
        "reference",
        "make-model",
        "--arch",
        "llama",
        "--train-steps",
        "0",
        "--set",
        "hidden_size=256",
        "--set",
        "num_hidden_layers=1",
        "--set",
        "hidden_act=gelu",
        "--out",
        str(out),
    )
    assert run.code == 0, run.err
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["hidden_act"]) == (
        256,
        1,
        "gelu",
    )


def test_the_tiny_deepseek_v3_is_configured_as_kimi_k2(models: dict[str, Path]) -> None:
    """K2's own routing and position fields in the config, under K2's names (which SGLang's
    DeepSeek model reads) and transformers 5's; and the model honouring them as transformers
    does: YaRN's mscale squared on the attention scale, the routed experts' scaling."""
    import math

    from transformers import AutoModelForCausalLM

    config = json.loads((models["dsv3"] / "config.json").read_text())
    assert config["rope_scaling"] == {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert config["rope_theta"] == 50000.0 and config["max_position_embeddings"] == 2048
    k2 = {
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.827,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    }
    assert {k: config[k] for k in k2} == k2
    model = AutoModelForCausalLM.from_pretrained(models["dsv3"])
    attn = model.model.layers[0].self_attn
    mscale = 0.1 * math.log(32.0) + 1.0
    head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert math.isclose(attn.scaling, head**-0.5 * mscale * mscale, rel_tol=1e-6)
    assert model.model.layers[1].mlp.gate.routed_scaling_factor == 2.827
