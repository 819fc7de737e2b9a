"""The CPU-performance workload (issue 6), shared by ``benchmarks.cpu_perf`` and ``benchmarks.serving``.

Fixed seed; ``requests`` prompts of random token ids with lengths uniform in ``[min_prompt,
max_prompt]`` (inclusive), ``max_tokens`` new tokens each (greedy, EOS ignored); ``adapters``
random non-zero PEFT LoRA adapters on all seven projections, adapter ``i`` of rank
``ranks[i % len(ranks)]``; request ``i`` uses adapter ``i % adapters`` (round robin) in the
LoRA runs. Adapters are written once (``tests/adapter_factory.py``) into plain PEFT
directories under the loraserve cache, so loraserve, PEFT and vLLM all load the same files.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._quick import parse_with_quick

FIRST_PLAIN_TOKEN = 32  # skip the special tokens at the start of the vocabulary
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROOT = Path(__file__).resolve().parents[1]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload options (defaults: the issue's workload)."""
    group = parser.add_argument_group("workload (defaults: the issue's workload)")
    group.add_argument("--requests", type=int, default=64, help="requests (default 64)")
    group.add_argument("--adapters", type=int, default=8, help="LoRA adapters, used round robin (default 8)")
    group.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64], help="ranks cycled over adapters (8,16,32,64)")
    group.add_argument("--min-prompt", type=int, default=32, help="shortest prompt in tokens (default 32)")
    group.add_argument("--max-prompt", type=int, default=128, help="longest prompt in tokens, inclusive (default 128)")
    group.add_argument("--max-tokens", type=int, default=64, help="new tokens per request, EOS ignored (default 64)")
    group.add_argument("--seed", type=int, default=0, help="workload and adapter seed (default 0)")
    group.add_argument("--quick", action="store_true", help="smoke test: 8 requests of 8-24 prompt and 8 new tokens")


QUICK_WORKLOAD = {"requests": 8, "min_prompt": 8, "max_prompt": 24, "max_tokens": 8}  # --quick's workload


def parse_workload_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` (``--quick``'s values where an option is not given) and validate the workload."""
    args = parse_with_quick(parser, argv, QUICK_WORKLOAD)
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need 1 <= --min-prompt <= --max-prompt")
    if args.requests < 1 or args.adapters < 1 or args.max_tokens < 1 or not args.ranks or min(args.ranks) < 1:
        parser.error("--requests, --adapters, --max-tokens and --ranks must be positive")
    return args


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and the adapter index of each request in the LoRA runs."""

    prompts: list[list[int]]
    adapter_of: list[int]
    max_tokens: int

    @classmethod
    def make(cls, args: argparse.Namespace, vocab: int) -> Workload:
        rng = random.Random(args.seed)
        lens = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]
        prompts = [[rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)] for n in lens]
        return cls(prompts, [i % args.adapters for i in range(args.requests)], args.max_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def describe(self, args: argparse.Namespace) -> str:
        ranks = [rank_of(i, args) for i in range(args.adapters)]
        return (
            f"{len(self.prompts)} requests (seed {args.seed}), prompts {args.min_prompt}-{args.max_prompt} tokens "
            f"(mean {self.prompt_tokens / len(self.prompts):.0f}, random ids), {self.max_tokens} new tokens each, "
            f"greedy, EOS ignored; {args.adapters} adapters of ranks {ranks} on all seven projections, round robin"
        )


def rank_of(index: int, args: argparse.Namespace) -> int:
    ranks: list[int] = args.ranks
    return ranks[index % len(ranks)]


def adapter_name(index: int) -> str:
    """The name (and the HTTP ``model`` id) of adapter ``index``: ``a0``, ``a1``, ..."""
    return f"a{index}"


def default_adapter_root() -> Path:
    from loraserve.models.loader import cache_root

    return cache_root() / "bench-adapters" / "cpu-perf"


def ensure_adapters(args: argparse.Namespace, hf_config: Any, root: Path | None = None) -> list[tuple[str, Path]]:
    """PEFT directories of the workload's adapters (written on first use): ``[(name, dir), ...]``."""
    root = root or default_adapter_root()
    found: list[tuple[str, Path]] = []
    factory: Any = None
    for i in range(args.adapters):
        rank, seed = rank_of(i, args), 1000 * args.seed + i
        path = root / f"r{rank}-s{seed}"
        if not (path / "adapter_model.safetensors").is_file():
            if factory is None:
                factory = _load_factory()
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:  # write, then rename: no half-written adapters
                written = factory.make_peft_adapter_for_config(
                    hf_config, Path(tmp) / "adapter", rank=rank, target_modules=list(TARGETS), seed=seed
                )
                written.rename(path)
        found.append((adapter_name(i), path))
    return found


def _load_factory() -> Any:
    spec = importlib.util.spec_from_file_location("adapter_factory", ROOT / "tests" / "adapter_factory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
