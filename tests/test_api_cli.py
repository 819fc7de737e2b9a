"""The ``serve`` subcommand's arguments (no model is loaded)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from loraserve.config import ConfigError, EngineConfig
from loraserve.entrypoints.serve import add_serve_parser, build_engine_config, build_settings, default_registry_spec


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
        assert config.registry and "registries" in config.registry
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
    eager = parse("--adapter-decode-path", "eager", "--kernels", "triton")
    assert build_engine_config(eager).adapter_decode_path == "eager"
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


def test_default_registry_is_one_per_base_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each base model gets its own default adapter directory (an adapter of one model does not fit
    another); the same model, named by another path to it, keeps its own; adapters left in the
    registry all models shared before are pointed at once."""
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path)
    default, first, second = default_registry_spec(None), default_registry_spec("a"), default_registry_spec("b")
    assert len({default, first, second}) == 3
    assert default.startswith(f"dir:{tmp_path / 'cache' / 'registries' / 'SmolLM2-135M-Instruct-'}")
    assert first.startswith(f"dir:{tmp_path / 'cache' / 'registries' / 'a-'}")
    assert default_registry_spec(str(tmp_path / "a")) == first == build_engine_config(parse("--model", "a")).registry
    assert not caplog.records
    (tmp_path / "cache" / "adapters" / "mine").mkdir(parents=True)
    default_registry_spec("b")
    assert "--registry dir:" + str(tmp_path / "cache" / "adapters") in caplog.text


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
    with pytest.raises(SystemExit, match="--shutdown-timeout must be a number of seconds >= 0"):  # before Ray
        run_serve(parse("--ray-address", "local", "--shutdown-timeout", "-1"))
    for value in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit, match="--shutdown-timeout must be a number of seconds >= 0"):
            run_serve(parse("--shutdown-timeout", value))


def test_ports_past_65535_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """uvloop would bind 70000 as 4464 (modulo 65536) while the log said 70000."""
    assert parse("--port", "65535").port == 65535
    for port in ("70000", "-5"):
        with pytest.raises(SystemExit):
            parse("--port", port)
        assert "is not a TCP port (0-65535)" in capsys.readouterr().err


def test_empty_values_are_refused_not_taken_for_absent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--admin-key "$KEY"`` with KEY unset gave a server open to anyone; an empty
    ``--allowed-lora-dir`` allowed the current directory."""
    monkeypatch.delenv("LORASERVE_API_KEY", raising=False)
    for argv, flag in ((["--admin-key", ""], "--admin-key"), (["--api-key", ""], "--api-key"),
                       (["--served-model-name", ""], "--served-model-name"),
                       (["--allowed-lora-dir", ""], "--allowed-lora-dir")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{flag} is empty"):
            build_settings(parse(*argv), tmp_path)
    monkeypatch.setenv("LORASERVE_API_KEY", "")  # set but empty: refused too
    with pytest.raises(ValueError, match="--api-key is empty"):
        build_settings(parse(), tmp_path)


def test_vllm_api_key_alone_is_warned_about(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("LORASERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    with caplog.at_level("WARNING"):
        settings = build_settings(parse(), Path("/models/m"))
    assert settings.api_key is None and "VLLM_API_KEY is set, but loraserve reads --api-key" in caplog.text


def test_config_refuses_wrong_types_and_options_that_cannot_apply() -> None:
    """Options from YAML, JSON or the environment come as strings: "false" is not False."""
    cases = [
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be bool, got 'false'"),
        ({"async_scheduling": "no"}, "async_scheduling must be bool"),
        ({"max_num_seqs": 8.5}, "max_num_seqs must be int, got 8.5"),
        ({"max_model_len": True}, "max_model_len must be int or None, got True"),
        ({"watermark": "0.1"}, "watermark must be float"),
        ({"num_swap_pages": 16}, "would be allocated and never used"),
        ({"kernels": "cpu", "device": "cuda"}, "kernels='cpu' .* runs on the CPU"),
        ({"device": "meta"}, "device must be 'cpu' or 'cuda"),
        ({"adapter_decode_path": "graph"}, "needs kernels 'triton'"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            EngineConfig(**options)  # type: ignore[arg-type]
    assert EngineConfig(watermark=0, preemption_mode="swap", num_swap_pages=16).watermark == 0
    assert EngineConfig(adapter_decode_path="graph", kernels="triton").adapter_decode_path == "graph"
    assert EngineConfig.from_options(Path("/m")).model == "/m"  # a path object is a model directory


def test_engine_start_failures_end_serve_with_one_line(tiny_model_dir: Path) -> None:
    """Options the config cannot judge alone (the model's context, this machine's devices) and a
    model that is not there end ``serve`` with one line naming the problem, not a traceback."""
    from loraserve.entrypoints.serve import start_engine

    base = {"model": str(tiny_model_dir), "kernels": "torch", "num_pages": 16}
    with pytest.raises(SystemExit, match=r"bad option: max_model_len=100000 is above the model's context of 2048"):
        start_engine(EngineConfig(**base, max_model_len=100_000))  # type: ignore[arg-type]
    if not __import__("torch").cuda.is_available():
        with pytest.raises(SystemExit, match=r"bad option: device 'cuda': no such CUDA device here"):
            start_engine(EngineConfig(**{**base, "device": "cuda"}))  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match=r"the engine could not start \(ModelLoadError\): model '/nope/m'"):
        start_engine(EngineConfig(**{**base, "model": "/nope/m"}))  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match=r"bad option: registry 'Redis://h:1/0': unknown scheme 'Redis'"):
        start_engine(EngineConfig(**base, registry="Redis://h:1/0"))  # type: ignore[arg-type]
    if __import__("loraserve.kernels.cpu", fromlist=["load_extension"]).load_extension() is not None:
        half = {**base, "kernels": "cpu", "dtype": "float16", "cpu_lora": "vector"}
        with pytest.raises(SystemExit, match=r"bad option: cpu_lora='vector' needs .* a float32 or bfloat16 model, "
                                             r"not kernels 'cpu' with float16"):  # fmt: skip
            start_engine(EngineConfig(**half))  # type: ignore[arg-type]
