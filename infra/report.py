"""``rlake report RUN_ID --out report.html``: a run's story told from the lake (not from memory).

Reads ``trajectories`` (train rows), ``train_steps``, ``evals`` and ``runs``; writes PNG figures
next to the HTML (``{stem}-{figure}.png``) and an HTML page that shows them with a per-iteration
table.
"""

from __future__ import annotations

import html
import json
import statistics
import urllib.parse
from collections import defaultdict
from pathlib import Path

from buffer import Lake
from rollout.sample import train_reward

# "record" is not there: the train_steps row is written during that phase
TIME_PHASES = ("generate", "score", "lake_write", "slice_read", "train", "publish")


def rollout_by_iteration(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per iteration: reward mean (as trained: a failed or non-finite reward counts 0), response
    length mean (tokens), truncation rate
    (share of status == 'truncated'), generating weight version (min), sample count."""
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["iteration"]].append(r)
    out = {}
    for it, rs in sorted(groups.items()):
        out[it] = {
            "reward": statistics.fmean(train_reward(r["reward"]) for r in rs),  # inf: failed
            "length": statistics.fmean(len(r["response_token_ids"] or []) for r in rs),
            "truncated": sum(r["status"] == "truncated" for r in rs) / len(rs),
            "version": min(r["weight_version"] for r in rs),
            "n": len(rs),
        }
    return out


def collect(lake: Lake, run_id: str) -> dict:
    """Everything the report shows, as plain Python data."""
    run = lake.get_run(run_id)
    if run is None:
        raise ValueError(f"no run '{run_id}' in the lake at {lake.uri}")
    traj = lake.read("trajectories", run_id=run_id, columns=[
        "iteration", "kind", "weight_version", "reward", "status", "response_token_ids"]).to_pylist()
    steps = sorted(lake.read("train_steps", run_id=run_id).to_pylist(), key=lambda s: s["step"])
    evals = lake.read("evals", run_id=run_id).to_pylist()
    metrics: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for e in evals:
        metrics[f"{e['dataset']}/{e['metric']}"].append((e["weight_version"], e["value"]))
    # a set's failed_ratio is shown only where some of its rewards failed (a flat 0 otherwise)
    metrics = {k: v for k, v in metrics.items()
               if not k.endswith("/failed_ratio") or any(x > 0 for _, x in v)}
    return {"run": run, "rollout": rollout_by_iteration([r for r in traj if r["kind"] == "train"]),
            "steps": steps, "evals": {k: sorted(v) for k, v in metrics.items()}}


def same_series(series: dict[str, list]) -> list[tuple[list, list[str]]]:
    """Series with identical points drawn once, under all their names (greedy accuracy,
    pass@1 and the mean 0/1 reward are often the same numbers): [(points, [names])]."""
    groups: dict[str, tuple[list, list[str]]] = {}
    for name, points in series.items():
        groups.setdefault(repr(points), (points, []))[1].append(name)
    return list(groups.values())


def legend_below(ax, handles: list | None = None, ncol: int = 3, fontsize: int = 8) -> None:
    """The legend under the axes (below the x-axis label), never over a curve: a legend inside
    covered the entropy curve, which starts high exactly where ``upper left`` puts it."""
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=ncol,
              fontsize=fontsize, frameon=False)


def build_figures(data: dict) -> list[tuple[str, str, object]]:
    """The report's matplotlib figures: [(file suffix, title, figure)]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ro, steps, evals = data["rollout"], data["steps"], data["evals"]
    its = list(ro)
    out: list[tuple[str, str, object]] = []

    def add(fig, name: str, title: str) -> None:
        for axis in fig.axes:  # iterations and versions are whole numbers
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        out.append((name, title, fig))

    fig, ax = plt.subplots(figsize=(7, 4.0))
    source = data["run"].get("replay_of")
    ax.plot([ro[i]["version"] for i in its], [ro[i]["reward"] for i in its], "o-", ms=3,
            label=f"replayed reward (by {source}'s generating version)" if source
            else "rollout reward (mean, by generating version)")
    for points, names in same_series(evals):
        ax.plot([v for v, _ in points], [x for _, x in points], "s--", ms=4, label=" = ".join(names))
    ax.set(xlabel="weight version", ylabel="reward / accuracy", ylim=(-0.02, 1.02),
           title="Reward and held-out evaluation per weight version")
    ax.grid(alpha=0.3)
    legend_below(ax, ncol=2)
    add(fig, "reward", "Reward and held-out accuracy")

    s_its = [s["iteration"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4.0))
    ax.plot(s_its, [s["ppo_kl"] or 0.0 for s in steps], "o-", ms=3, label="ppo_kl (rollout vs current)")
    if any(s["kl_loss"] is not None for s in steps):
        ax.plot(s_its, [s["kl_loss"] or 0.0 for s in steps], "o-", ms=3, label="kl_loss (vs reference)")
    ax.set(xlabel="iteration", ylabel="KL")
    ax2 = ax.twinx()
    ax2.plot(s_its, [s["entropy"] or 0.0 for s in steps], "^-", ms=3, color="tab:green",
             label="entropy")
    ax2.set_ylabel("entropy (nats/token)", color="tab:green")
    ax.set_title("KL and entropy per iteration")
    ax.grid(alpha=0.3)
    legend_below(ax, ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0])
    add(fig, "kl_entropy", "KL and entropy")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(its, [ro[i]["length"] for i in its], "o-", ms=3, label="response length")
    ax.set(xlabel="iteration", title="Response length and truncation rate")
    ax.set_ylabel("response length (tokens)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(its, [ro[i]["truncated"] for i in its], "s-", ms=3, color="tab:red", label="truncated")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("truncation rate", color="tab:red")
    ax.grid(alpha=0.3)
    add(fig, "length", "Response length and truncation rate")

    fig, ax = plt.subplots(figsize=(7, 4.0))
    for key, style in (("staleness_min", "v-"), ("staleness_mean", "o-"), ("staleness_max", "^-")):
        ax.plot(s_its, [s[key] or 0.0 for s in steps], style, ms=3, label=key.split("_")[1])
    ax.set(xlabel="iteration", ylabel="versions behind", title="Staleness of trained samples")
    ax.grid(alpha=0.3)
    legend_below(ax)
    add(fig, "staleness", "Staleness")

    fig, ax = plt.subplots(figsize=(7, 4.0))
    timings = [json.loads(s["timings"] or "{}") for s in steps]
    bottom = [0.0] * len(steps)
    for phase in TIME_PHASES:
        values = [t.get(phase, 0.0) for t in timings]
        ax.bar(s_its, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="iteration", ylabel="seconds", title="Time split per iteration")
    legend_below(ax, ncol=len(TIME_PHASES), fontsize=7)
    add(fig, "time", "Time split per iteration")
    return out


def _figures(data: dict, stem: Path) -> list[tuple[str, Path]]:
    """Save ``build_figures`` as ``{stem}-{name}.png``: [(title, path)]."""
    import matplotlib.pyplot as plt

    out = []
    for name, title, fig in build_figures(data):
        path = stem.with_name(f"{stem.name}-{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends sit below the axes
        plt.close(fig)
        out.append((title, path))
    return out


def _table(data: dict) -> str:
    ro = data["rollout"]
    head = ("iteration", "base → new version", "samples", "reward", "length", "truncated",
            "ppo_kl", "entropy", "staleness mean", "lake version", "seconds")
    rows = []
    for s in data["steps"]:
        r = ro.get(s["iteration"], {})
        total = sum(json.loads(s["timings"] or "{}").get(p, 0.0) for p in TIME_PHASES)
        cells = (s["iteration"], f"{s['base_version']} → {s['weight_version']}", s["n_samples"],
                 f"{r.get('reward', float('nan')):.3f}", f"{r.get('length', float('nan')):.2f}",
                 f"{r.get('truncated', float('nan')):.2f}", f"{s['ppo_kl'] or 0.0:.5f}",
                 f"{s['entropy'] or 0.0:.3f}", f"{s['staleness_mean'] or 0.0:.2f}",
                 s["lake_version"], f"{total:.2f}")
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table>")


def image_src(path: Path) -> str:
    """``path``'s file name as an ``<img src>`` relative URL, percent-quoted then HTML-escaped: a
    name with ``#``, ``%``, ``?`` or ``"`` (from ``--out``) broke the images (review, 2026-11-29)."""
    return html.escape(urllib.parse.quote(path.name))


def write_report(lake: Lake, run_id: str, out: Path, home: str | None = None) -> list[Path]:
    """Write ``out`` (HTML) and its PNG figures; returns every file written. The status shown is
    ``rlake status``'s for ``home`` (``shown_status``): the lake alone says "running" for a run
    killed mid-way."""
    from infra.status import shown_status

    data = collect(lake, run_id)
    if not data["steps"]:
        raise ValueError(f"run '{run_id}' has no train_steps yet: nothing to report")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = _figures(data, out.with_suffix(""))
    run = data["run"]
    evals = "".join(f"<li>{html.escape(k)}: " + ", ".join(f"v{v}={x:.3f}" for v, x in pts) + "</li>"
                    for k, pts in data["evals"].items())
    lineage = "".join(f"<li>{k}: {html.escape(str(run[k]))}</li>" for k in ("replay_of", "parent_run_id")
                      if run.get(k))
    body = "".join(f'<h2>{html.escape(t)}</h2><img src="{image_src(p)}" alt="{html.escape(t)}">'
                   for t, p in figures)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>rlake run {html.escape(run_id)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}table{{border-collapse:collapse;
font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}img{{max-width:100%}}</style>
</head><body><h1>rlake run {html.escape(run_id)}</h1>
<ul><li>status: {html.escape(str(shown_status(run, home)))}</li><li>MLflow run: {html.escape(str(run.get('mlflow_run_id')))}</li>
<li>iterations: {len(data['steps'])}, samples trained: {sum(s['n_samples'] or 0 for s in data['steps'])}</li>{lineage}</ul>
<h2>Held-out evaluation</h2><ul>{evals or '<li>none</li>'}</ul>{body}
<h2>Per iteration</h2>{_table(data)}</body></html>"""
    out.write_text(page)
    return [out, *(p for _, p in figures)]
