"""``freeze_startup_objects``: garbage is collected first, what lives is frozen (full collections
then skip it), and serving calls it (``tests/test_graceful_shutdown.py`` reads the server's log)."""

from __future__ import annotations

import gc
import weakref

from loraserve.entrypoints.startup_heap import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_garbage_is_collected_and_live_objects_frozen() -> None:
    garbage = _Node()
    garbage.other = _Node()
    garbage.other.other = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    live = [_Node()]
    del garbage
    assert dead() is not None
    try:
        frozen = freeze_startup_objects()
        assert dead() is None  # collected before the freeze, not frozen with the rest
        # frozen objects that die later leave the permanent generation (other threads of the test
        # process free some), and nothing joins it without another freeze: the count only falls
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(obj is live for obj in gc.get_objects())  # frozen objects are out of the collector's lists
    finally:
        gc.unfreeze()  # the test process keeps collecting as before
    assert any(obj is live for obj in gc.get_objects())
