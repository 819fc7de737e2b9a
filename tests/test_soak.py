"""The soak's CI version (``benchmarks/soak.py``): a real server (the tiny model) for 60 s under
64 clients with streamed and plain requests on the base model and adapters, 10 % cut by the client
at random points, adapters uploaded and deleted while in use; then no silent drop, no error of any
kind, the server healthy and back to idle (nothing queued, no page held), and it stops on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import soak

pytestmark = pytest.mark.slow


def test_soak_60_seconds(tiny_model_dir: Path) -> None:
    args = soak.parse_args(["--model", str(tiny_model_dir), "--duration", "60", "--clients", "64", "--adapters", "4",
                            "--server-arg=--num-pages=600"])  # fmt: skip
    report = soak.run(args)
    assert report["silent_drops"] == 0 and report["errors"] == {}, report
    assert report["served"] > 100 and report["cancelled_by_client"] > 5, report
    assert report["adapter_uploads"] >= 5 and report["adapter_deletes"] >= 3, report
    assert report["after"]["idle"] and report["after"]["health"] == 200, report["after"]
    assert report["shutdown"]["exit_code"] == 0, report["shutdown"]
    assert report["ok"]
