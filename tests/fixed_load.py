"""Stand-ins for ``cpu_load.OtherLoad`` in tests of the timed kernel choices: a machine whose other
processes kept a fixed number of CPUs busy, whatever really runs beside the tests."""

from __future__ import annotations

from loraserve.models.cpu_load import DISTURBED_CORES


class QuietLoad:
    """Other processes kept ``CORES`` CPUs busy (none: every timing counts as undisturbed)."""

    CORES = 0.0

    def __enter__(self) -> QuietLoad:
        self.cores = self.CORES
        self.disturbed = self.cores >= DISTURBED_CORES
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class BusyLoad(QuietLoad):
    """Other processes kept a whole CPU busy: every timing counts as disturbed."""

    CORES = 1.0
