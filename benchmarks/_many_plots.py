"""PNG plots of ``benchmarks.many_adapters`` (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from benchmarks._many_report import KINDS, SYSTEMS, RunResult

COLORS = {"loraserve": "C0", "fixed": "C1", "reserve": "C2", "peft-one": "C3", "peft-mixed": "C4"}
KIND_COLORS = {"kv": "C0", "adapter": "C3", "adapter_idle": "C1", "prefix_cache": "C7", "free": "0.92"}


def plot_all(results: list[RunResult], slo_ttft: float, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    ran = [r for r in results if not r.skipped]
    paths = [throughput(ran, slo_ttft, out_dir / "many_adapters_throughput.png"),
             cdfs(ran, slo_ttft, out_dir / "many_adapters_latency_cdf.png")]  # fmt: skip
    if any(r.timeline for r in ran):
        paths.append(pool(ran, out_dir / "many_adapters_pool.png"))
    return paths


def throughput(results: list[RunResult], slo_ttft: float, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in SYSTEMS:
        runs = sorted((r for r in results if r.system == system), key=lambda r: r.num_adapters)
        if not runs:
            continue
        ns = [r.num_adapters for r in runs]
        summaries = [r.summary(slo_ttft) for r in runs]
        for ax, key in zip(axes, ("tok_s", "slo_attainment"), strict=True):
            ax.plot(ns, [s[key] or 0.0 for s in summaries], "-o", color=COLORS[system], label=SYSTEMS[system])
            for n, s in zip(ns, summaries, strict=True):
                if s["timed_out"]:
                    ax.plot([n], [s[key] or 0.0], "x", color="k", markersize=10)
    axes[0].set(xscale="log", xlabel="adapters N", ylabel="output tokens/s", title="Throughput (x: timed out)")
    axes[1].set(xscale="log", xlabel="adapters N", ylabel="share of requests", ylim=(0, 1.05),
                title=f"SLO attainment (TTFT < {slo_ttft:g} s)")  # fmt: skip
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cdfs(results: list[RunResult], slo_ttft: float, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ns = sorted({r.num_adapters for r in results})
    fig, axes = plt.subplots(2, len(ns), figsize=(4 * len(ns), 7), squeeze=False)
    for col, n in enumerate(ns):
        for r in (r for r in results if r.num_adapters == n):
            done = [r.timings[i] for i in r.done]
            for row, values in enumerate(([t.ttft for t in r.timings], [t.tpot for t in done])):
                xs = sorted(v * (1e3 if row else 1.0) for v in values if v is not None)
                if xs:
                    ys = [(k + 1) / len(r.timings) for k in range(len(xs))]  # unfinished requests never reach 1
                    axes[row][col].step(xs, ys, where="post", color=COLORS[r.system], label=SYSTEMS[r.system])
        axes[0][col].axvline(slo_ttft, color="k", linestyle=":", linewidth=1)
        axes[0][col].set(title=f"N={n}: TTFT", xlabel="seconds", xscale="log")
        axes[1][col].set(title=f"N={n}: time per output token", xlabel="ms", xscale="log")
        for row in (0, 1):
            axes[row][col].set(ylabel="share of requests", ylim=(0, 1.02))
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pool(results: list[RunResult], path: Path) -> Path:
    import matplotlib.pyplot as plt

    engines = [s for s in SYSTEMS if any(r.system == s and r.timeline for r in results)]
    ns = sorted({r.num_adapters for r in results if r.timeline})
    fig, axes = plt.subplots(len(engines), len(ns), figsize=(4 * len(ns), 2.8 * len(engines)), squeeze=False)
    for row, system in enumerate(engines):
        for col, n in enumerate(ns):
            ax = axes[row][col]
            run = next((r for r in results if r.system == system and r.num_adapters == n and r.timeline), None)
            ax.set(title=f"{SYSTEMS[system]}, N={n}", xlabel="seconds", ylabel="pages")
            ax.title.set_fontsize(8)
            if run is None:
                continue
            ts = [p[0] for p in run.timeline]
            stacks = [[p[1 + j] for p in run.timeline] for j in range(len(KINDS))]
            ax.stackplot(ts, stacks, labels=KINDS, colors=[KIND_COLORS[k] for k in KINDS], step="post")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
