"""What this CPU is: its model name and the instruction-set features the kernels care about.

Two things depend on it and so are keyed by ``signature()``: the compiled kernels (built with
``-march=native``, so a build from another CPU may hold instructions this one lacks) and the
kernels chosen per shape by timing (``models/gemm_choice.py`` and the other choices). The
signature includes the vendor, family, model, stepping and cache size that ``/proc/cpuinfo``
reports, not only the model name and flags: virtual machines often name different CPUs alike
("Intel(R) Xeon(R) Processor") with the same flags, and a choice timed on one is not the other's.
Benchmarks print ``summary()`` beside every figure.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

# The features that change which instructions a kernel may use or how fast a GEMM runs.
ISA_FEATURES = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx_ne_convert",
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx512vbmi",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    identity: str  # vendor, family, model, stepping and cache size, e.g. "GenuineIntel family 6 model 207 ..."
    machine: str  # platform.machine(): x86_64, aarch64, ...
    features: tuple[str, ...]  # the ISA_FEATURES this CPU has, in ISA_FEATURES order
    num_cpus: int

    def has(self, feature: str) -> bool:
        return feature in self.features

    @property
    def onednn_bfloat16(self) -> bool:
        """Whether oneDNN can pack and run bfloat16 linear weights here: torch's mkldnn bfloat16
        path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT and raises on other CPUs."""
        return self.has("avx_ne_convert") or all(self.has(f) for f in ("avx512bw", "avx512vl", "avx512dq"))

    @property
    def vector_isa(self) -> str:
        """The widest float vector ISA: ``avx512``, ``avx2``, ``sse`` or the machine name."""
        if self.has("avx512f") and self.has("avx512vl"):
            return "avx512"
        if self.has("avx2") and self.has("fma"):
            return "avx2"
        return "sse" if self.machine == "x86_64" else self.machine


# The /proc/cpuinfo fields that tell CPUs of the same model name apart, as the identity names them.
IDENTITY_FIELDS = {
    "vendor_id": "",
    "cpu family": "family",
    "model": "model",
    "stepping": "stepping",
    "cache size": "cache",
}


def _parse_cpuinfo(text: str) -> tuple[str, str, set[str], int]:
    """The first processor's model name, identity (``IDENTITY_FIELDS``) and flags; the processor count."""
    model, count = "", 0
    flags: set[str] = set()
    identity: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            count += 1
        elif key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key in IDENTITY_FIELDS and key not in identity:
            identity[key] = value.strip()
    words = [f"{IDENTITY_FIELDS[key]} {identity[key]}".strip() for key in IDENTITY_FIELDS if identity.get(key)]
    return model, " ".join(words), flags, count


@functools.cache
def cpu_info() -> CpuInfo:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the platform's description only
        text = ""
    model, identity, flags, count = _parse_cpuinfo(text)
    return CpuInfo(
        model_name=model or platform.processor() or "unknown",
        identity=identity,
        machine=platform.machine(),
        features=tuple(f for f in ISA_FEATURES if f in flags),
        num_cpus=count,
    )


def signature(info: CpuInfo | None = None) -> str:
    """A short digest of the model name, identity, machine and ISA features (what a build or a
    choice depends on) of ``info``, by default this CPU's."""
    info = info or cpu_info()
    text = "|".join((info.model_name, info.identity, info.machine, ",".join(info.features)))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def summary() -> str:
    """One line for logs and benchmark headers: model, vector ISA and the notable features."""
    info = cpu_info()
    notable = [f for f in info.features if f.startswith(("avx512", "amx", "avx_vnni")) or f in ("avx2", "fma")]
    identity = f"{info.identity}; " if info.identity else ""
    return f"{info.model_name} ({identity}{info.machine}; {info.vector_isa}; {' '.join(notable) or 'no AVX'})"
