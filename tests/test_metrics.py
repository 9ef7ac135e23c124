"""Metrics: flattening of stage markers, and the JSON-lines record when W&B is off."""

import json

from jobs.metrics import MetricsLog, stage_metrics
from stages.runtime.config import load_config


def test_stage_metrics_flatten_numbers_only():
    marker = {"stage": "gather", "rank": None, "attempts": 3, "duration_s": 1.5, "summary": "text",
              "stats": {"reward_mean": 0.25, "accuracy": 0.5}, "memory": {"host_rss_peak_gib": 0.4},
              "outputs": {"a": {"size": 1}}, "hosts": ["n1"]}
    assert stage_metrics("gather", marker) == {
        "gather/duration_s": 1.5, "gather/memory/host_rss_peak_gib": 0.4, "gather/retries": 2,
        "rollout/reward_mean": 0.25, "rollout/accuracy": 0.5}


def test_disabled_wandb_still_records_every_stage(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "wandb.enabled=false"])
    m = MetricsLog(cfg)
    m.stage_done(0, "train", {"attempts": 1, "loss_mean": 0.5})
    m.stage_done(1, "train", {"attempts": 2, "loss_mean": 0.25})
    m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["train/loss_mean"], r["train/retries"]) for r in rows] == [(0, 0.5, 0), (1, 0.25, 1)]
    assert not (tmp_path / "wandb").exists()


def test_report_figure_has_whole_iteration_ticks_and_names_the_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from jobs.report import report_figure
    from stages.runtime.paths import STAGES

    rows = [{"iteration": i, "reward_mean": 0.1 * i, "accuracy": 0.05 * i, **{f"{s}_s": 1.0 for s in STAGES}}
            for i in range(2)]
    fig = report_figure(rows, str(tmp_path / "run"))
    fig.canvas.draw()
    for ax in fig.axes:
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()
    assert fig._suptitle.get_text() == f"syncrl: {(tmp_path / 'run').resolve()}"
