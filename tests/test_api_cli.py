"""The ``serve`` subcommand's arguments (no model is loaded)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from loraserve.config import ConfigError, EngineConfig
from loraserve.entrypoints.serve import add_serve_parser, build_engine_config, build_settings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loraserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORASERVE_API_KEY", raising=False)
    monkeypatch.delenv("LORASERVE_ADMIN_KEY", raising=False)
    args = parse()
    assert (args.host, args.port, args.model, args.api_key, args.admin_key) == ("127.0.0.1", 8000, None, None, None)
    assert args.allowed_lora_dir == [] and args.max_upload_mb == 512
    config = build_engine_config(args)
    if hasattr(config, "registry"):
        assert config.registry and "adapters" in config.registry
        config = dataclasses.replace(config, registry=EngineConfig().registry)
    assert config == EngineConfig()
    settings = build_settings(args, Path("/models/SmolLM2-135M-Instruct"))
    assert settings.model_id == "SmolLM2-135M-Instruct" and settings.adapter_key is None
    assert settings.allowed_lora_dirs == ()


def test_every_option(tmp_path: Path) -> None:
    args = parse(
        "--model", str(tmp_path), "--served-model-name", "base", "--host", "0.0.0.0", "--port", "9000",
        "--api-key", "k1", "--admin-key", "k2", "--allowed-lora-dir", str(tmp_path),
        "--allowed-lora-dir", str(tmp_path / "b"), "--max-upload-mb", "3", "--block-size", "32",
        "--num-pages", "100", "--memory-budget-mb", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--device", "cpu", "--dtype", "bfloat16", "--no-enable-prefix-caching",
        "--max-lora-rank", "32", "--max-adapters", "7", "--enforce-eager", "--max-request-body-mb", "2",
        "--max-n", "3", "--max-prompt-tokens", "100", "--max-output-tokens", "50", "--max-requests-per-key", "9",
        "--shutdown-timeout", "5",
    )  # fmt: skip
    config = build_engine_config(args)
    assert config.enable_prefix_caching is False
    assert (config.model, config.block_size, config.num_pages, config.memory_budget_mb) == (str(tmp_path), 32, 100, 64)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.dtype) == (4, 128, "bfloat16")
    settings = build_settings(args, tmp_path)
    assert (settings.model_id, settings.api_key, settings.admin_key) == ("base", "k1", "k2")
    assert settings.allowed_lora_dirs == (str(tmp_path.resolve()), str((tmp_path / "b").resolve()))
    assert settings.max_upload_bytes == 3 * 2**20
    assert (config.max_lora_rank, config.max_adapters, config.enforce_eager) == (32, 7, True)
    assert build_engine_config(parse("--adapter-decode-path", "eager")).adapter_decode_path == "eager"
    assert build_engine_config(parse("--async-scheduling")).async_scheduling is True
    swap = build_engine_config(
        parse(
            "--watermark", "0.05", "--preemption-mode", "swap", "--num-swap-pages", "12", "--host-adapter-cache-mb", "9"
        )
    )
    assert (swap.watermark, swap.preemption_mode, swap.num_swap_pages, swap.host_adapter_cache_mb) == (
        0.05,
        "swap",
        12,
        9,
    )
    assert config.async_scheduling is False  # off unless asked
    assert (settings.max_request_body_bytes, settings.max_n, settings.max_requests_per_key) == (2 * 2**20, 3, 9)
    assert (settings.max_prompt_tokens, settings.max_output_tokens, args.shutdown_timeout) == (100, 50, 5.0)


def test_step_token_budget_defaults_by_device_and_dtype() -> None:
    """Unset, a step's token budget is 1,024 for float32 on a CPU and 2,048 otherwise (at least
    max_num_seqs); set, it is what was set."""
    assert build_engine_config(parse()).step_token_budget == 1024
    assert build_engine_config(parse("--dtype", "bfloat16")).step_token_budget == 2048
    assert EngineConfig(device="cuda").step_token_budget == 2048
    assert EngineConfig(max_num_batched_tokens=300).step_token_budget == 300
    assert EngineConfig(max_num_seqs=1500).step_token_budget == 1500  # a decode step of every sequence fits
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be positive"):
        EngineConfig(max_num_batched_tokens=0)


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_API_KEY", "env-user")
    monkeypatch.setenv("LORASERVE_ADMIN_KEY", "env-admin")
    args = parse()
    assert (args.api_key, args.admin_key) == ("env-user", "env-admin")


def test_bad_engine_options_name_the_option() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        build_engine_config(parse("--block-size", "3"))
    with pytest.raises(ConfigError, match="preemption_mode='swap' needs num_swap_pages"):
        build_engine_config(parse("--preemption-mode", "swap"))
    with pytest.raises(ConfigError, match="watermark must be in"):
        build_engine_config(parse("--watermark", "1.5"))


def test_bad_options_end_serve_with_a_message_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad engine or server option ends ``serve`` with "bad option: ..." naming it (no traceback),
    before any model is loaded, on one process and on Ray alike."""
    from loraserve import llm_engine
    from loraserve.entrypoints.serve import run_serve

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_model)
    with pytest.raises(SystemExit, match=r"bad option: .*max_num_seqs"):
        run_serve(parse("--max-num-seqs", "0"))
    with pytest.raises(SystemExit, match=r"bad option: .*max_n"):
        run_serve(parse("--max-n", "0"))
    with pytest.raises(SystemExit, match=r"bad option: max_n must be at most 1024"):  # n's ceiling in the schema
        run_serve(parse("--max-n", "1025"))
    with pytest.raises(SystemExit, match=r"bad option: .*block_size"):
        run_serve(parse("--ray-address", "local", "--block-size", "3"))


def test_every_option_has_help() -> None:
    parser = argparse.ArgumentParser(prog="loraserve")
    serve = add_serve_parser(parser.add_subparsers(dest="command"))
    for action in serve._actions:
        assert action.help, action.option_strings


def test_options_that_would_do_nothing_are_refused() -> None:
    from loraserve.entrypoints.serve import run_serve

    with pytest.raises(SystemExit, match="--num-replicas needs --ray-address"):
        run_serve(parse("--num-replicas", "2"))
    with pytest.raises(SystemExit, match="--shutdown-timeout must be >= 0"):  # checked before Ray starts
        run_serve(parse("--ray-address", "local", "--shutdown-timeout", "-1"))
    with pytest.raises(SystemExit, match="--shutdown-timeout must be >= 0"):
        run_serve(parse("--shutdown-timeout", "-1"))
