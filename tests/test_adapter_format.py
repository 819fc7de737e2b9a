"""PEFT adapter parsing: weights, PEFT-exact scales and targets, and digests (validation errors:
``test_adapter_validation.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import (
    make_peft_adapter,
    make_peft_adapter_for_config,
    make_peft_model,
    tiny_llama_config,
)
from loraserve.adapters import (
    WEIGHTS_FILE,
    BaseModelShapes,
    LoRAAdapter,
    load_adapter,
    parse_adapter_files,
)
from loraserve.adapters.peft_config import parse_lora_config
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key
from peft_adapter_files import (  # noqa: F401 (pytest fixtures: base_model, shapes, adapter_dir, files)
    ALL_PROJECTIONS,
    Files,
    adapter_dir_fixture,
    base_model_fixture,
    edit_files,
    files_fixture,
    peft_key,
    shapes_fixture,
)
from safetensors.torch import load_file
from transformers import LlamaForCausalLM


def _lora_layers(peft_model: Any) -> dict[tuple[int, str], LoraLayer]:
    layers = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.r:
            parts = name.split(".")
            layers[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return layers


def test_shapes_from_hf_config_handles_gqa_and_head_dim() -> None:
    config = tiny_llama_config(hidden=64, intermediate=96, heads=4, kv_heads=2, num_layers=3)
    shapes = BaseModelShapes.from_hf_config(config)
    assert shapes.num_layers == 3
    assert shapes.module_shapes["q_proj"] == (64, 64)
    assert shapes.module_shapes["k_proj"] == (64, 32)
    assert shapes.module_shapes["o_proj"] == (64, 64)
    assert shapes.module_shapes["down_proj"] == (96, 64)
    config.head_dim = 32  # explicit head_dim different from hidden // heads
    assert BaseModelShapes.from_hf_config(config).module_shapes["q_proj"] == (64, 128)
    del config.head_dim
    assert BaseModelShapes.from_hf_config(config).module_shapes["v_proj"] == (64, 32)


def test_parsed_tensors_equal_what_peft_saved(adapter_dir: Path, shapes: BaseModelShapes) -> None:
    adapter = load_adapter(adapter_dir, shapes, "a")
    saved = load_file(adapter_dir / WEIGHTS_FILE)
    assert len(adapter.weights) == 2 * 7 and len(saved) == 2 * 2 * 7
    for (layer, module), weights in adapter.weights.items():
        assert weights.lora_a.dtype == torch.float32 and weights.lora_b.dtype == torch.float32
        assert torch.equal(weights.lora_a, saved[peft_key(layer, module, "A")])
        assert torch.equal(weights.lora_b, saved[peft_key(layer, module, "B")])
        assert weights.scale == 2.0
    assert adapter.target_modules == tuple(sorted(ALL_PROJECTIONS))
    assert adapter.max_rank == 4 and adapter.ranks == {m: 4 for m in sorted(ALL_PROJECTIONS)}
    assert adapter.rank_of(1, "k_proj") == 4
    expected_params = sum(t.numel() for t in saved.values())
    assert adapter.num_parameters == expected_params and adapter.num_bytes == 4 * expected_params


SCALE_CASES: dict[str, dict[str, Any]] = {
    "plain": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
    "alpha_ne_r": {"rank": 4, "alpha": 16, "target_modules": ALL_PROJECTIONS},
    "rslora": {"rank": 16, "alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "down_proj"]},
    "rank_pattern": {
        "rank": 4,
        "alpha": 8,
        "target_modules": ALL_PROJECTIONS,
        "rank_pattern": {"layers.1.self_attn.q_proj": 8, "down_proj": 2, r"model\.layers\.0\.mlp\.up_proj": 6},
    },
    "alpha_pattern": {
        "rank": 4,
        "alpha": 8,
        "target_modules": ["q_proj", "v_proj", "up_proj"],
        "alpha_pattern": {"v_proj": 32, "model.layers.0.mlp.up_proj": 3},
    },
    "regex_targets": {"rank": 2, "alpha": 5, "target_modules": r".*\.layers\.1\.(self_attn\.(q|v)_proj|mlp\.up_proj)"},
    "layers_to_transform": {"rank": 4, "target_modules": ["k_proj", "o_proj"], "layers_to_transform": [1]},
    "all_linear": {"rank": 2, "alpha": 3, "target_modules": "all-linear"},
    "exclude_modules": {
        "rank": 2,
        "target_modules": ["q_proj", "k_proj"],
        "exclude_modules": ["layers.0.self_attn.k_proj"],
    },
}


@pytest.mark.parametrize("case", sorted(SCALE_CASES))
def test_ranks_scales_and_targets_match_peft_layers(
    case: str, base_model: LlamaForCausalLM, shapes: BaseModelShapes, tmp_path: Path
) -> None:
    peft_model = make_peft_model(base_model, seed=3, **SCALE_CASES[case])
    peft_model.save_pretrained(tmp_path)
    adapter = load_adapter(tmp_path, shapes, case)
    peft_layers = _lora_layers(peft_model)
    assert set(adapter.weights) == set(peft_layers)
    for key, layer in peft_layers.items():
        weights = adapter.weights[key]
        assert weights.rank == layer.r["default"], key
        assert weights.scale == pytest.approx(layer.scaling["default"], rel=1e-12), key
        assert torch.equal(weights.lora_a, layer.lora_A["default"].weight.detach())
        assert torch.equal(weights.lora_b, layer.lora_B["default"].weight.detach())


def test_lora_delta_matches_peft_module_outputs(
    base_model: LlamaForCausalLM, shapes: BaseModelShapes, tmp_path: Path
) -> None:
    peft_model = make_peft_model(base_model, rank=4, alpha=12, target_modules=ALL_PROJECTIONS, seed=5)
    peft_model.save_pretrained(tmp_path)
    adapter = load_adapter(tmp_path, shapes, "e2e")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (layer, module), peft_layer in _lora_layers(peft_model).items():
            in_features = shapes.module_shapes[module][0]
            x = torch.randn(3, in_features, generator=generator)
            weights = adapter.weights[(layer, module)]
            base_weight = peft_layer.get_base_layer().weight
            expected = x @ base_weight.T + weights.scale * (x @ weights.lora_a.T) @ weights.lora_b.T
            torch.testing.assert_close(peft_layer(x), expected, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(expected, x @ base_weight.T)  # the adapter really does something


def test_config_only_factory_matches_peft_layout(
    base_model: LlamaForCausalLM, shapes: BaseModelShapes, tmp_path: Path
) -> None:
    kwargs: dict[str, Any] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    kwargs["rank_pattern"] = {"layers.1.self_attn.q_proj": 8}
    from_model = make_peft_adapter(base_model, tmp_path / "model", **kwargs)
    from_config = make_peft_adapter_for_config(base_model.config, tmp_path / "config", **kwargs)
    assert set(load_file(from_model / WEIGHTS_FILE)) == set(load_file(from_config / WEIGHTS_FILE))
    a, b = load_adapter(from_model, shapes, "m"), load_adapter(from_config, shapes, "c")
    assert {k: (w.rank, w.scale) for k, w in a.weights.items()} == {k: (w.rank, w.scale) for k, w in b.weights.items()}


def test_half_precision_weights_become_float32(
    base_model: LlamaForCausalLM, shapes: BaseModelShapes, tmp_path: Path
) -> None:
    path = make_peft_adapter_for_config(
        base_model.config, tmp_path, rank=2, target_modules=["v_proj"], dtype=torch.bfloat16
    )
    adapter = load_adapter(path, shapes, "bf16")
    saved = load_file(path / WEIGHTS_FILE)
    weights = adapter.weights[(0, "v_proj")]
    assert weights.lora_a.dtype == torch.float32
    assert torch.equal(weights.lora_a, saved[peft_key(0, "v_proj", "A")].float())


def _digest(files: Files, shapes: BaseModelShapes, name: str = "a") -> str:
    return parse_adapter_files(files, shapes, name).digest


def test_digest_is_stable_and_name_independent(adapter_dir: Path, files: Files, shapes: BaseModelShapes) -> None:
    digest = _digest(files, shapes)
    assert len(digest) == 64
    assert load_adapter(adapter_dir, shapes, "other-name").digest == digest
    assert _digest(dict(files), shapes, "again") == digest

    def strip_prefix(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.removeprefix("base_model.model.")] = tensors.pop(key)

    # Same content under the other key layout peft writes, in another order: same adapter.
    assert _digest(edit_files(files, tensors=strip_prefix), shapes) == digest


def test_digest_changes_with_any_weight_or_scale(files: Files, shapes: BaseModelShapes) -> None:
    digest = _digest(files, shapes)

    def nudge(tensors: dict[str, torch.Tensor]) -> None:
        tensors[peft_key(1, "up_proj", "B")][3, 1] += 1e-6

    def set_alpha(config: dict[str, Any]) -> None:
        config["lora_alpha"] = 9

    assert _digest(edit_files(files, tensors=nudge), shapes) != digest
    assert _digest(edit_files(files, config=set_alpha), shapes) != digest


def test_key_variants_parse_identically(files: Files, shapes: BaseModelShapes) -> None:
    def with_adapter_name(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.replace(".weight", ".default.weight")] = tensors.pop(key)

    plain = parse_adapter_files(files, shapes, "a")
    named = parse_adapter_files(edit_files(files, tensors=with_adapter_name), shapes, "a")
    assert named.digest == plain.digest
    assert torch.equal(named.weights[(0, "q_proj")].lora_b, plain.weights[(0, "q_proj")].lora_b)


@pytest.mark.parametrize(
    "raw",
    [
        {"target_modules": ["q_proj", "v_proj"], "rank_pattern": {"q_proj": 8, "layers.1.self_attn.v_proj": 2}},
        {"target_modules": ["self_attn.q_proj", "mlp.down_proj"], "layers_to_transform": 0},
        {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
        {"target_modules": r".*\.(q|k)_proj", "exclude_modules": r".*layers\.1\.self_attn\.k_proj"},
        {"target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"], "layers_to_transform": [1]},
        {"target_modules": ["gate_proj"], "rank_pattern": {r"layers\.\d\.mlp\.gate_proj": 3, "gate_proj": 5}},
        {"target_modules": ["down_proj"], "alpha_pattern": {"ayers.0.mlp.down_proj": 3, "proj": 7}},
    ],
)
def test_matching_rules_agree_with_peft_helpers(raw: dict[str, Any]) -> None:
    peft_config = LoraConfig(r=4, lora_alpha=8, **raw)
    ours = parse_lora_config(json.dumps(peft_config.to_dict(), default=list).encode())
    keys = [
        peft_key(i, m, "A").removeprefix("base_model.model.")[: -len(".lora_A.weight")]
        for i in range(2)
        for m in ALL_PROJECTIONS
    ]
    for key in keys:
        assert ours.is_targeted(key) == bool(check_target_module_exists(peft_config, key)), key
        rank = peft_config.rank_pattern.get(get_pattern_key(peft_config.rank_pattern.keys(), key), 4)
        alpha = peft_config.alpha_pattern.get(get_pattern_key(peft_config.alpha_pattern.keys(), key), 8)
        assert ours.rank_for(key) == rank, key
        assert ours.scale_for(key) == alpha / rank, key


def test_rank_of_unadapted_module_is_zero(
    base_model: LlamaForCausalLM, shapes: BaseModelShapes, tmp_path: Path
) -> None:
    path = make_peft_adapter(base_model, tmp_path, rank=2, target_modules=["q_proj"], layers_to_transform=[1])
    adapter: LoRAAdapter = load_adapter(path, shapes, "a")
    assert adapter.rank_of(1, "q_proj") == 2
    assert adapter.rank_of(0, "q_proj") == 0 and adapter.rank_of(1, "v_proj") == 0
    assert adapter.target_modules == ("q_proj",) and adapter.ranks == {"q_proj": 2}
