"""PEFT adapter validation: every unsupported or malformed config, tensor set and file set is refused with an
AdapterError naming the problem; huge but finite weights are accepted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import tiny_llama_config
from loraserve.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    BaseModelShapes,
    load_adapter,
    parse_adapter_files,
)
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


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config[field] = value

    return edit


Q0A, Q0B = peft_key(0, "q_proj", "A"), peft_key(0, "q_proj", "B")


# (config edit, tensor edit, expected message fragments)
ERROR_CASES: dict[str, tuple[Any, Any, tuple[str, ...]]] = {
    "dora": (_set("use_dora", True), None, ("DoRA", CONFIG_FILE)),
    "modules_to_save": (_set("modules_to_save", ["lm_head"]), None, ("modules_to_save",)),
    "bias": (_set("bias", "all"), None, ("bias",)),
    "peft_type": (_set("peft_type", "IA3"), None, ("peft_type", "IA3")),
    "fan_in_fan_out": (_set("fan_in_fan_out", True), None, ("fan_in_fan_out",)),
    "lora_bias": (_set("lora_bias", True), None, ("lora_bias",)),
    "pissa_residual": (_set("init_lora_weights", "pissa_niter_4"), None, ("init_lora_weights",)),
    "embed_target": (
        _set("target_modules", [*ALL_PROJECTIONS, "embed_tokens"]),
        None,
        ("embed_tokens", "not supported"),
    ),
    "lm_head_target": (_set("target_modules", [*ALL_PROJECTIONS, "lm_head"]), None, ("lm_head", "not supported")),
    "unknown_target": (_set("target_modules", ["c_attn"]), None, ("c_attn", "not supported")),
    "regex_hits_norm": (_set("target_modules", r".*(_proj|_layernorm)"), None, ("layernorm", "unsupported")),
    "bad_regex": (_set("rank_pattern", {"q_proj(": 2}), None, ("regular expression",)),
    "flag_in_rank_pattern": (_set("rank_pattern", {"(?i)q_proj": 2}), None, ("rank_pattern", "regular expression")),
    "bad_layers_pattern": (
        lambda c: c.update(layers_pattern="(", layers_to_transform=[0]),
        None,
        ("layers_pattern", "regular expression"),
    ),
    # Patterns that backtracked without end held the GIL and stopped the server (each times out in 0.1 s):
    "endless_target_regex": (_set("target_modules", r"(.*){1,32000}[bc]"), None, ("takes more than", "simplify")),
    "endless_rank_pattern": (_set("rank_pattern", {r"(.*){1,32000}[bc]": 2}), None, ("takes more than",)),
    "endless_exclude": (_set("exclude_modules", r"(.*){1,32000}[bc]"), None, ("takes more than",)),
    "rslora_string": (_set("use_rslora", "false"), None, ("use_rslora must be true or false",)),
    "config_rank": (_set("r", 8), None, ("rank 4 does not match", "r=8")),
    "negative_r": (_set("r", -1), None, ("r must be a positive integer",)),
    "nan": (None, lambda t: t[Q0A].__setitem__((0, 0), float("nan")), ("NaN", Q0A)),
    "inf": (None, lambda t: t[Q0B].__setitem__((1, 1), float("inf")), ("infinite", Q0B)),
    "past_float32": (
        None,
        lambda t: t.__setitem__(Q0A, torch.full_like(t[Q0A], 1e300, dtype=torch.float64)),
        ("float32's range", Q0A),
    ),
    "rank_a_vs_b": (None, lambda t: t.__setitem__(Q0B, torch.ones(64, 5)), ("rank mismatch", "q_proj")),
    "missing_b": (None, lambda t: t.pop(Q0B), ("missing lora_B", "layer 0 q_proj")),
    "missing_module": (None, lambda t: [t.pop(Q0A), t.pop(Q0B)], ("missing lora_A/lora_B", "layer 0 q_proj")),
    "untargeted_weights": (_set("target_modules", ALL_PROJECTIONS[1:]), None, ("does not target", "q_proj")),
    "dora_tensor": (
        None,
        lambda t: t.__setitem__(Q0A.replace("lora_A.weight", "lora_magnitude_vector"), torch.ones(64)),
        ("DoRA",),
    ),
    "embedding_tensor": (
        None,
        lambda t: t.__setitem__("base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(4, 128)),
        ("embed",),
    ),
    "lm_head_tensor": (
        None,
        lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.ones(4, 64)),
        ("lm_head",),
    ),
    "saved_module": (
        None,
        lambda t: t.__setitem__("base_model.model.lm_head.modules_to_save.default.weight", torch.ones(2, 2)),
        ("modules_to_save",),
    ),
    "layer_out_of_range": (
        None,
        lambda t: t.__setitem__(Q0A.replace("layers.0", "layers.7"), torch.ones(4, 64)),
        ("layer 7 does not exist",),
    ),
    "int_dtype": (None, lambda t: t.__setitem__(Q0A, torch.ones(4, 64, dtype=torch.int32)), ("dtype", Q0A)),
}


def test_inits_that_leave_the_base_model_alone_are_served(files: Files, shapes: BaseModelShapes) -> None:
    """MiCA's adapters are plain LoRA at inference (peft's MiCALinearVariant; vLLM accepts them)."""
    plain = parse_adapter_files(files, shapes, "plain")
    for init in ("mica", "gaussian", "orthogonal", True):
        edited = edit_files(files, config=_set("init_lora_weights", init))
        assert parse_adapter_files(edited, shapes, "init").digest == plain.digest


def test_a_layers_pattern_is_checked_only_where_peft_uses_it(files: Files, shapes: BaseModelShapes) -> None:
    """peft reads ``layers_pattern`` only with ``layers_to_transform``; ``use_rslora`` as truthy."""
    unused = edit_files(files, config=lambda c: c.update(layers_pattern="(", use_rslora=0))
    assert parse_adapter_files(unused, shapes, "ok").max_rank == 4


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_invalid_adapters_raise_adapter_error(case: str, files: Files, shapes: BaseModelShapes) -> None:
    config_edit, tensor_edit, fragments = ERROR_CASES[case]
    with pytest.raises(AdapterError) as info:
        parse_adapter_files(edit_files(files, config=config_edit, tensors=tensor_edit), shapes, "bad")
    for fragment in fragments:
        assert fragment in str(info.value), (case, str(info.value))


def test_shape_mismatch_with_base_model_names_module_and_shapes(files: Files) -> None:
    other = BaseModelShapes.from_hf_config(tiny_llama_config(hidden=32, intermediate=128, heads=4, kv_heads=2))
    with pytest.raises(AdapterError, match=r"shape mismatch") as info:
        parse_adapter_files(files, other, "bad")
    message = str(info.value)
    assert "q_proj" in message and "[r, 32]" in message and "[4, 64]" in message


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda f: f.pop(CONFIG_FILE), "missing adapter_config.json"),
        (lambda f: f.pop(WEIGHTS_FILE), "missing adapter_model.safetensors"),
        (lambda f: f.__setitem__(CONFIG_FILE, b"{not json"), "malformed JSON"),
        (lambda f: f.__setitem__(CONFIG_FILE, b"[1, 2]"), "JSON object"),
        (lambda f: f.__setitem__(WEIGHTS_FILE, b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"), "safetensors"),
        (lambda f: f.__setitem__("adapter_model.bin", b"\x80\x04pickle"), "pickle"),
        (lambda f: f.__setitem__("optimizer.pt", b"\x80\x04pickle"), "pickle"),
    ],
)
def test_file_level_errors(
    mutate: Callable[[Files], object], fragment: str, files: Files, shapes: BaseModelShapes
) -> None:
    edited = dict(files)
    mutate(edited)
    with pytest.raises(AdapterError, match=fragment):
        parse_adapter_files(edited, shapes, "bad")


def test_directory_with_only_pickle_weights_is_refused(files: Files, shapes: BaseModelShapes, tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_bytes(files[CONFIG_FILE])
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(AdapterError, match="pickle") as info:
        load_adapter(tmp_path, shapes, "bad")
    assert "adapter_model.bin" in str(info.value)
    with pytest.raises(AdapterError, match="not a directory"):
        load_adapter(tmp_path / "missing", shapes, "bad")


def test_huge_finite_weights_whose_sum_overflows_are_accepted(files: Files, shapes: BaseModelShapes) -> None:
    """The finiteness check sums the weights; a sum that overflows must fall back to the exact check."""

    def huge(tensors: dict[str, torch.Tensor]) -> None:
        tensors[Q0A] = torch.full_like(tensors[Q0A], 3e38)

    adapter = parse_adapter_files(edit_files(files, tensors=huge), shapes, "huge")
    assert float(adapter.weights[(0, "q_proj")].lora_a.sum()) == float("inf")  # the overflow did happen
