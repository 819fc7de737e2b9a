"""The mark of the tests that need the compiled LoRA kernel's AMX tiles: skipped, by this reason, on
CPUs without them (the vector loops' tests run everywhere)."""

from __future__ import annotations

import pytest
from loraserve.kernels import cpu

NO_AMX = "the AMX tiles are not in this CPU's build (no amx_bf16/avx512_bf16) or the OS refused them"
needs_amx = pytest.mark.skipif(cpu.load_extension() is None or not cpu.lora_amx(), reason=NO_AMX)
