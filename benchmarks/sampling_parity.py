"""Do sampling parameters change two OpenAI-compatible servers' outputs the same way?

    python -m benchmarks.sampling_parity --url loraserve=http://127.0.0.1:8002 --url vllm=http://127.0.0.1:8001

For each setting (greedy; greedy with one penalty at a time; all of them together; ``min_p``, which
leaves greedy decoding alone) it sends the same prompts to every server (``/v1/completions``,
``temperature 0``, EOS ignored) and reports, per setting, how many prompts got exactly the same
text from all servers, the mean length of the common prefix, and on how many prompts each server's
text differs from its own plain greedy text (so a parameter that is accepted and ignored shows up
as 0 changes). The penalties are vLLM's definitions; both servers run the same model in float32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "List the numbers from one to twenty:",
    "Repeat after me: la la la la la",
    "The capital of France is",
    "Write a short poem about the sea and the sea and the sea.",
    "Q: What is two plus two?\nA:",
    "def fibonacci(n):",
    "My favourite colours are red, red, red and",
    "Once upon a time, in a small village,",
]
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "presence_penalty 0.5": {"presence_penalty": 0.5},
    "frequency_penalty 0.5": {"frequency_penalty": 0.5},
    "repetition_penalty 1.2": {"repetition_penalty": 1.2},
    "all three": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "min_p 0.05 (greedy: no change)": {"min_p": 0.05},
    "logit_bias {1000: 4}": {"logit_bias": {"1000": 4}},
    "bad_words [the, and, one]": {"bad_words": ["the", "and", "one"]},
    "allowed_token_ids 0..4999": {"allowed_token_ids": list(range(5000))},
}


def complete(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    reply = client.post(f"{url}/v1/completions", json=body)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


def common_prefix(texts: list[str]) -> int:
    """Characters all ``texts`` share at their start."""
    length = 0
    for chars in zip(*texts, strict=False):
        if len(set(chars)) != 1:
            break
        length += 1
    return length


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="NAME=BASE_URL (repeat; two or more)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--settings", default=None, help="names to run, separated by ; (default: all)")
    args = parser.parse_args(argv)
    wanted = [] if args.settings is None else [name.strip() for name in args.settings.split(";") if name.strip()]
    unknown = [name for name in wanted if name not in SETTINGS]
    if unknown or (args.settings is not None and not wanted):
        parser.error(f"--settings: unknown setting(s) {unknown or [args.settings]}; known: {'; '.join(SETTINGS)}")
    chosen = SETTINGS if args.settings is None else {"greedy": {}, **{name: SETTINGS[name] for name in wanted}}
    bad_urls = [item for item in args.url if "=" not in item or not item.split("=", 1)[0]]
    if bad_urls or len(args.url) < 2:
        parser.error(f"--url expects NAME=BASE_URL, at least twice; got {args.url}")
    servers = dict(item.split("=", 1) for item in args.url)
    texts: dict[str, dict[str, list[str]]] = {}
    with httpx.Client(timeout=600) as client:
        for setting, extra in chosen.items():
            texts[setting] = {
                name: [complete(client, url, args.model, p, args.max_tokens, extra) for p in PROMPTS]
                for name, url in servers.items()
            }
    names = list(servers)
    print(f"{len(PROMPTS)} prompts, {args.max_tokens} tokens each, greedy, EOS ignored; servers: {servers}")
    print("| setting | same text on all servers | mean common prefix (chars) | "
          + " | ".join(f"{name}: changed vs its greedy" for name in names) + " |")  # fmt: skip
    print("|---|---:|---:|" + "---:|" * len(names))
    rows = []
    for setting in chosen:
        per_server = texts[setting]
        same = sum(len({per_server[n][i] for n in names}) == 1 for i in range(len(PROMPTS)))
        prefix = sum(common_prefix([per_server[n][i] for n in names]) for i in range(len(PROMPTS))) / len(PROMPTS)
        changed = [sum(a != b for a, b in zip(per_server[n], texts["greedy"][n], strict=True)) for n in names]
        changes = dict(zip(names, changed, strict=True))
        rows.append({"setting": setting, "same": same, "mean_common_prefix": prefix, "changed": changes})
        cells = " | ".join(f"{c}/{len(PROMPTS)}" for c in changed)
        print(f"| {setting} | {same}/{len(PROMPTS)} | {prefix:.1f} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps({"servers": servers, "rows": rows, "texts": texts}, indent=1))


if __name__ == "__main__":
    main()
