"""`syncrl report RUN_DIR`: reward/accuracy and stage-time plots (PNG) and a Markdown summary.

Everything is read from the stage markers, the run's source of truth; matplotlib draws off-screen.
"""

from __future__ import annotations

from pathlib import Path

from stages.runtime import markers
from stages.runtime.paths import STAGES, RunPaths
from stages.runtime.pipeline import BACKGROUND_STAGES


def collect(run_dir: str) -> list[dict]:
    """One row per iteration with a gather marker: rollout stats and each finished stage's duration."""
    paths = RunPaths(run_dir)
    rows = []
    for it in paths.iterations_present():
        gather = markers.read_marker(paths, it, "gather")
        if gather is None:
            continue
        row = {"iteration": it, **gather["stats"]}
        for stage in STAGES:
            m = markers.read_marker(paths, it, stage)
            row[f"{stage}_s"] = m.get("duration_s") if m else None
            row[f"{stage}_attempts"] = m.get("attempts") if m else None
        train = markers.read_marker(paths, it, "train") or {}
        row["loss"] = train.get("loss_mean")
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"{paths.root}: no finished iteration yet (no gather marker)")
    return rows


def write_report(run_dir: str, out_dir: str | None = None) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = collect(run_dir)
    png, md = RunPaths(run_dir).report(out_dir)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig = report_figure(rows, run_dir)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    md.write_text(markdown(rows, png.name))
    return png, md


def report_figure(rows: list[dict], run_dir: str):
    """The two panels: reward and accuracy, and stage wall time, per iteration."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    its = [r["iteration"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ax1.plot(its, [r["reward_mean"] for r in rows], marker="o", label="mean reward")
    ax1.plot(its, [r["accuracy"] for r in rows], marker="s", label="accuracy")
    ax1.set_xlabel("iteration")
    ax1.set_title("reward and accuracy")
    ax1.grid(alpha=0.3)
    ax1.legend()
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        if stage in BACKGROUND_STAGES:
            continue  # it overlaps the next iteration's stages: stacking it would count that time twice
        heights = [r[f"{stage}_s"] or 0.0 for r in rows]
        ax2.bar(its, heights, bottom=bottom, label=stage)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("seconds")
    ax2.set_title("stage wall time per iteration" +
                  (f" ({', '.join(BACKGROUND_STAGES)}: in the background, not shown)" if BACKGROUND_STAGES else ""))
    ax2.legend(fontsize="small")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
    fig.suptitle(f"syncrl: {Path(run_dir).resolve()}")  # the run's path: its last part is often just "run"
    fig.tight_layout()
    return fig


def markdown(rows: list[dict], png_name: str) -> str:
    head = ["iteration", "reward", "accuracy", "zero-var groups", "length", "truncated", "loss",
            *[f"{s} s" for s in STAGES], "retries"]
    lines = [f"![run]({png_name})", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        retries = sum((r[f"{s}_attempts"] or 1) - 1 for s in STAGES)
        cells = [str(r["iteration"]), f"{r['reward_mean']:.3f}", f"{r['accuracy']:.3f}",
                 f"{r['zero_variance_groups']:.2f}", f"{r['length_mean']:.1f}", f"{r['truncated']:.2f}",
                 "-" if r["loss"] is None else f"{r['loss']:.4f}",
                 *["-" if r[f"{s}_s"] is None else f"{r[f'{s}_s']:.1f}" for s in STAGES], str(retries)]
        lines.append("| " + " | ".join(cells) + " |")
    first, last = rows[0], rows[-1]
    lines += ["", f"Reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}, accuracy "
              f"{first['accuracy']:.3f} -> {last['accuracy']:.3f} over iterations {first['iteration']}-"
              f"{last['iteration']}.", ""]
    return "\n".join(lines)
