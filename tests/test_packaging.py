"""Our top-level folders install under ``loraserve.`` and never shadow well-known packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_subpackages_resolve_to_the_repository_folders() -> None:
    import loraserve.adapters
    import loraserve.api
    import loraserve.kernels

    assert Path(loraserve.kernels.__file__).parent == ROOT / "kernels"
    assert Path(loraserve.adapters.__file__).parent == ROOT / "adapters"
    assert Path(loraserve.api.__file__).parent == ROOT / "api"


def test_no_top_level_kernels_adapters_or_api_and_hf_imports_unaffected(tmp_path: Path) -> None:
    """Run from another directory, as users do: the generic names stay free for other packages."""
    script = (
        "import importlib.util, json, loraserve, transformers, peft\n"
        "from loraserve.kernels import lora\n"
        "specs = {name: importlib.util.find_spec(name) for name in ('kernels', 'adapters', 'api')}\n"
        "print(json.dumps({name: (spec.origin if spec else None) for name, spec in specs.items()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True, timeout=300
    )
    origins = json.loads(result.stdout.strip().splitlines()[-1])
    for name, origin in origins.items():
        assert origin is None or not str(origin).startswith(str(ROOT)), f"{name} resolves to {origin}"
