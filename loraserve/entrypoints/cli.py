"""The ``loraserve`` command: ``generate`` (offline) and ``serve`` (HTTP API)."""

from __future__ import annotations

import argparse
import logging
import sys

from loraserve.entrypoints.engine_args import add_engine_arguments, engine_options
from loraserve.entrypoints.serve import add_serve_parser, run_serve


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate completions for prompts (offline, no server)",
        description="Generate completions with the base model or LoRA adapters and print them.",
    )
    parser.add_argument("prompts", nargs="+", help="prompt texts; each is one request")
    parser.add_argument(
        "--model", default=None, help="local Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: off)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (reproducible)")
    parser.add_argument("-n", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a PEFT LoRA directory under NAME (repeatable)",
    )
    parser.add_argument(
        "--use",
        action="append",
        default=None,
        metavar="NAME",
        help="adapter for the prompts: once for all, or once per prompt ('base' for none)",
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(parser)


def _run_generate(args: argparse.Namespace) -> int:
    from loraserve import LLM, SamplingParams

    adapters: dict[str, str] = {}
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --adapter expects NAME=PATH, got {spec!r}")
        if name in adapters:
            raise SystemExit(f"error: --adapter {name!r} is given twice")
        adapters[name] = path
    if adapters and args.use is None:
        raise SystemExit(f"error: --adapter registers {sorted(adapters)} but no --use names one; "
                         "add --use NAME (or --use base for the base model)")  # fmt: skip
    uses: list[str | None] = [None if u == "base" else u for u in (args.use or ["base"])]
    unknown = sorted({u for u in uses if u is not None} - adapters.keys())
    if unknown:
        raise SystemExit(f"error: --use {unknown[0]!r} is not registered by an --adapter NAME=PATH (nor 'base')")
    if len(uses) == 1:
        uses = uses * len(args.prompts)
    if len(uses) != len(args.prompts):
        raise SystemExit(f"error: --use given {len(uses)} times for {len(args.prompts)} prompts")
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **engine_options(args))
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts = list(args.prompts)
    if args.chat:
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    outputs = llm.generate(prompts, params, adapters=uses)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        for sample in output.outputs:
            label = f" [{output.adapter_name}]" if output.adapter_name else ""
            sys.stdout.write(f"--- {prompt!r}{label} (sample {sample.index}, {sample.finish_reason})\n")
            sys.stdout.write(sample.text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraserve", description="Multi-LoRA LLM serving with unified paging.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        try:
            return _run_generate(args)
        except (ValueError, RuntimeError, OSError) as error:  # ModelLoadError is a RuntimeError
            sys.stderr.write(f"error: {error}\n")
            return 2
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
