"""The compiled CPU kernels' sources compile for a CPU with every instruction set they have paths
for (Sapphire Rapids: AVX-512, AVX512-BF16, AMX tiles), whatever this machine is: a path that this
CPU's own build leaves out (the AMX tiles on an AMD, say) is still checked. Syntax only, no code
generated; the native build and its tests run elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from loraserve.kernels import cpu_build
from torch.utils.cpp_extension import include_paths


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to compile with")
def test_every_source_compiles_for_a_cpu_with_every_instruction_set() -> None:
    csrc = cpu_build._CSRC
    command = ["g++", "-std=c++17", "-fsyntax-only", "-march=sapphirerapids", "-fopenmp"]
    command += [f"-I{path}" for path in include_paths()]
    command += [f"-I{sysconfig.get_paths()['include']}", f"-I{csrc}"]

    def compile_errors(name: str) -> tuple[str, str]:
        done = subprocess.run([*command, str(csrc / name)], capture_output=True, text=True, check=False)
        return name, "" if done.returncode == 0 else done.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(compile_errors, cpu_build._SOURCES))
    assert sorted(results) == sorted(cpu_build._SOURCES)
    assert {name: errors for name, errors in results.items() if errors} == {}
