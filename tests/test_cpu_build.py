"""Building the compiled CPU kernels (``kernels/cpu_build.py``): one build directory per CPU and
checkout; a killed build and another ninja on PATH must not stop a later process from loading them."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loraserve.kernels import cpu, cpu_build, cpu_features

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")


def test_each_checkout_builds_in_its_own_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two checkouts on one machine (a clone for CI beside the working tree) never share a build
    directory: their build commands name other source files, so each would rebuild the other's."""
    here = cpu_build.build_dir()
    monkeypatch.setattr(cpu_build, "_CSRC", tmp_path / "kernels" / "csrc")
    assert cpu_build.build_dir() != here and cpu_build.build_dir().parent == here.parent


def test_the_build_directory_is_keyed_by_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build made on another CPU (a shared home directory) is never loaded here: its directory differs."""
    here = cpu_build.build_dir()
    assert here.name.startswith(cpu_features.signature() + "-") and here.parent.name == "torch_extensions"
    info = cpu_features.cpu_info()
    other = dataclasses.replace(info, features=(*(f for f in info.features if not f.startswith("avx512")), "x"))
    monkeypatch.setattr(cpu_features, "cpu_info", lambda: other)
    assert cpu_build.build_dir() != here and cpu_build.build_dir().parent == here.parent


def test_a_killed_build_does_not_block_later_loads(tmp_path: Path) -> None:
    """torch's ``lock`` baton left by a build killed mid-way made every later load wait forever."""
    directory = tmp_path / "torch_extensions" / cpu_build.build_dir().name
    shutil.copytree(cpu_build.build_dir(), directory)  # the built module (mtimes kept: ninja has nothing to do)
    (directory / "lock").touch()
    load = "from loraserve.kernels import cpu; import sys; sys.exit(0 if cpu.load_extension() is not None else 1)"
    result = subprocess.run(
        [sys.executable, "-c", load],
        env={**os.environ, "LORASERVE_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "left behind by an interrupted kernel build" in result.stderr
    assert not (directory / "lock").exists()


def test_the_build_uses_the_environments_ninja(tmp_path: Path) -> None:
    """A process whose PATH finds another ninja first (the system's, when the environment is not
    activated) still builds with the environment's: two ninjas of different versions made
    processes rebuild the extension for each other. Here the other ninja is one that fails."""
    if not (Path(sys.executable).parent / "ninja").exists():
        pytest.skip("no ninja next to this interpreter (not a virtual environment with ninja installed)")
    directory = tmp_path / "torch_extensions" / cpu_build.build_dir().name
    shutil.copytree(cpu_build.build_dir(), directory)  # the built module (mtimes kept: ninja has nothing to do)
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path}/other-ninja-ran\nexit 1\n")
    (other / "ninja").chmod(0o755)
    load = "from loraserve.kernels import cpu; import sys; sys.exit(0 if cpu.load_extension() is not None else 1)"
    env = {**os.environ, "LORASERVE_CACHE": str(tmp_path), "PATH": f"{other}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "other-ninja-ran").exists()
