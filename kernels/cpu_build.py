"""Building and loading the compiled CPU kernels (``csrc/``; their contracts are in ``cpu.py``).

The extension is compiled with ``torch.utils.cpp_extension.load`` into
``~/.cache/loraserve/torch_extensions/<CPU signature>-<checkout>`` on first use (about a minute; the
signature digests the CPU's model and instruction-set features, ``cpu_features.py``, so a
build is only ever loaded on the kind of CPU it was built for); when a compiler is
missing the engine logs why and falls back to the torch implementations. torch guards that
directory with a ``lock`` file that a killed build leaves behind, after which every later
``load`` waits forever; loraserve processes therefore serialize their builds with an
``flock`` (released by the kernel when its holder dies) and, holding it, remove such a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from loraserve.kernels import cpu_features

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "cpu_kernels.cpp",
    "elementwise.cpp",
    "lora_segments.cpp",
    "linear_panels.cpp",
    "linear_pair_panels.cpp",
    "linear_dot.cpp",
    "linear_amx.cpp",
    "prefill_attention.cpp",
    "token_bitmask.cpp",
)
_lock = threading.Lock()
_state: dict[str, ModuleType | str] = {}


def cache_root() -> Path:
    """loraserve's cache directory: ``$LORASERVE_CACHE`` or ``~/.cache/loraserve``."""
    return Path(os.environ.get("LORASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "loraserve"))


def build_dir() -> Path:
    """Where this CPU's build of these sources lives: one directory per CPU signature, since
    ``-march=native`` code from another CPU may use instructions this one lacks (a home directory
    shared between machines), and per checkout (a digest of the sources' path: two checkouts'
    builds in one directory rebuilt for each other, their commands naming other files)."""
    checkout = hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]
    return cache_root() / "torch_extensions" / f"{cpu_features.signature()}-{checkout}"


def source_digest() -> str:
    """A digest of every file in ``csrc/`` (what a build of the extension is made from)."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def environment_ninja_first() -> Iterator[None]:
    """During the build, the ninja of this interpreter's environment (``ninja`` is a dependency)
    first on ``PATH``, through a directory holding only a link to it. A ninja of another version
    (the system's, found when the environment is not activated) logs commands under other hashes,
    so processes that found different ninjas rebuilt the whole extension for each other."""
    ninja = Path(sys.executable).parent / "ninja" if sys.executable else None
    if ninja is None or not ninja.is_file():
        yield
        return
    old = os.environ.get("PATH")
    with tempfile.TemporaryDirectory(prefix="loraserve-ninja-") as only_ninja:
        (Path(only_ninja) / "ninja").symlink_to(ninja)
        os.environ["PATH"] = only_ninja + os.pathsep + (old if old is not None else os.defpath)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = old


@contextlib.contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on the build directory; clears torch's stale ``lock`` file."""
    with open(directory / "loraserve-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # the kernel drops it when the holding process dies
        # Every loraserve process calls torch's load() only while holding this flock, so a
        # baton file that exists now was left by a build that was killed.
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left behind by an interrupted kernel build", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_extension() -> ModuleType | None:
    """The compiled module, building it on first call; None (with the reason logged) if it cannot be built."""
    module = _state.get("module")  # the per-call path of every kernel: no lock once decided
    if module is not None:
        return module if isinstance(module, ModuleType) else None
    with _lock:
        if "module" in _state:
            module = _state["module"]
            return module if isinstance(module, ModuleType) else None
        try:
            from torch.utils.cpp_extension import load

            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            logger.info("building the CPU kernels (once per CPU: %s) in %s", cpu_features.summary(), directory)
            digest = source_digest()
            with _exclusive_build(directory), environment_ninja_first():
                module = load(
                    name="loraserve_cpu_kernels",
                    sources=[str(_CSRC / name) for name in _SOURCES],
                    # torch rebuilds when sources or flags change, not headers: the digest of all of csrc is a flag
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", f"-DLORASERVE_CSRC={digest}"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=False,
                )
        except Exception as error:  # a missing compiler or headers: serve with the torch kernels
            logger.warning("CPU kernels unavailable, using the torch implementations: %s", error)
            _state["module"] = str(error)
            return None
        _state["module"] = module
        return module
