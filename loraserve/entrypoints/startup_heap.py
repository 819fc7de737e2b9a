"""The objects a server creates at start, moved out of the cyclic garbage collector's sight.

A server's start leaves some 400,000 objects the collector tracks (torch, transformers, the
model's modules, FastAPI's routes) that live until the process ends. Each full collection
walks all of them: a stall of ~0.2 s in the middle of serving, every stream waiting (SmolLM2 on
2 cores, the CPU_PERF.md workload: one such collection in a 16 s run). :func:`freeze_startup_objects`,
called once the engine and the app are built, collects what is already garbage and freezes the
rest (``gc.freeze``, as vLLM's engine core does), so later collections walk only the objects of
requests. Frozen objects are never collected: a frozen cycle that later becomes garbage stays
in memory, which is why only long-lived start-up state should be frozen. At exit they are
unfrozen again, so that the interpreter's last collection frees them (extensions such as
Triton's bindings otherwise report their objects as leaked).
"""

from __future__ import annotations

import atexit
import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect garbage, then freeze every object the collector tracks; returns how many are frozen
    (the process's total, earlier freezes included)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however often this is called
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    logger.info("start-up objects frozen for the garbage collector: %d", frozen)
    return frozen
