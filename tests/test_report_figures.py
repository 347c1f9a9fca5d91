"""The report's figures: no legend drawn over the data (the KL/entropy legend once hid the
entropy curve), and non-finite rewards in the lake do not poison the reward curve."""

from __future__ import annotations

import json
import math

import pytest

from infra.report import build_figures, rollout_by_iteration


def _data(n: int = 12) -> dict:
    # entropy starts high and falls, KL grows: the shape of a real run, where the old
    # upper-left legend sat on the first entropy points
    steps = [{"iteration": i, "ppo_kl": 0.001 * i, "kl_loss": 0.002 * i, "entropy": 3.0 - 0.2 * i,
              "staleness_min": 0.0, "staleness_mean": 0.5, "staleness_max": 1.0,
              "timings": json.dumps({"generate": 1.0, "train": 0.5 + 0.1 * i})} for i in range(n)]
    rollout = {i: {"reward": min(1.0, 0.1 * i), "length": 4.0, "truncated": 0.1, "version": i, "n": 16}
               for i in range(n)}
    evals = {"held_out/accuracy": [(0, 0.1), (n, 0.9)], "held_out/pass@1": [(0, 0.1), (n, 0.9)]}
    return {"run": {"run_id": "r"}, "rollout": rollout, "steps": steps, "evals": evals}


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_no_legend_covers_any_axes_data_region():
    import matplotlib.pyplot as plt

    figures = build_figures(_data())
    assert {name for name, _, _ in figures} == {"reward", "kl_entropy", "length", "staleness", "time"}
    try:
        checked = 0
        for name, _, fig in figures:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
            for legend in legends:
                box = legend.get_window_extent(renderer)
                for ax in fig.axes:
                    assert not _overlap(box, ax.get_window_extent(renderer)), \
                        f"{name}: the legend covers the plotted area"
                    assert not _overlap(box, ax.xaxis.label.get_window_extent(renderer)), \
                        f"{name}: the legend covers the x-axis label"
                checked += 1
        assert checked == 4  # reward, kl_entropy, staleness, time have legends
        kl = dict((n, f) for n, _, f in figures)["kl_entropy"]
        labels = [t.get_text() for t in kl.axes[0].get_legend().get_texts()]
        assert labels == ["ppo_kl (rollout vs current)", "kl_loss (vs reference)", "entropy"]
    finally:
        for _, _, fig in figures:
            plt.close(fig)


def test_reward_curve_ignores_non_finite_rewards():
    rows = [{"iteration": 0, "reward": r, "response_token_ids": [1, 2], "status": "completed",
             "weight_version": 0} for r in (1.0, math.inf, -math.inf, None)]
    assert rollout_by_iteration(rows)[0]["reward"] == pytest.approx(0.25)
