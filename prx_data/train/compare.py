"""Side-by-side data ablations: two runs' metrics over steps, one PNG and one table.

The recipe's workflow: train the same small model on two variants of the data
(captioner A vs B: two configs that differ in ``data.caption_columns``; with vs
without a filter: they differ in ``data.datasets.N.skip_lists``) and compare
FID, CMMD, DINO-MMD and the held-out loss per timestep band at the same steps.
The numbers come from the JSON files the trainer writes per evaluation
(``gen-ba*.json`` by the metrics callback, ``eval-ba*.json`` per eval).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prx_data.core.errors import UsageError

#: Lower is better for every metric compared here.
ORDER = ("FID", "CMMD", "DINO-MMD", "FlowLoss")


@dataclass(frozen=True)
class RunMetrics:
    """One run: its label, its metrics folder and ``{metric: {batch: value}}``."""

    label: str
    folder: Path
    series: dict[str, dict[int, float]]


def metrics_dir(path: str | Path) -> Path:
    """The folder holding a run's evaluation JSON: ``path`` itself, or its metrics subfolder."""
    p = Path(path)
    for cand in (p, p / "metrics", p / "checkpoints" / "metrics"):
        if cand.is_dir() and any(cand.glob("*-ba*.json")):
            return cand
    raise UsageError(
        f"{path}: no evaluation results (gen-ba*.json / eval-ba*.json) there or in its "
        "metrics/ or checkpoints/metrics/ folder; pass the run folder, its save_folder or "
        "metrics.folder of a run trained with eval (and metrics) enabled"
    )


def load_run(path: str | Path, label: str | None = None) -> RunMetrics:
    folder = metrics_dir(path)
    series: dict[str, dict[int, float]] = {}
    for f in sorted(folder.glob("*-ba*.json")):
        try:
            rec = json.loads(f.read_text())
            batch = int(rec["batch"])
            values = dict(rec["metrics"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{f}: not an evaluation record ({exc})") from None
        for name, value in values.items():
            series.setdefault(str(name), {})[batch] = float(value)
    return RunMetrics(label or Path(path).name, folder, series)


def _sort_key(name: str) -> tuple[int, str]:
    for i, head in enumerate(ORDER):
        if name == head:
            return (i, "")
    return (len(ORDER), name)


def metric_names(runs: list[RunMetrics]) -> list[str]:
    names = {n for r in runs for n in r.series}
    return sorted(names, key=_sort_key)


def table(runs: list[RunMetrics]) -> str:
    """Per metric: each run's value at the last step both runs evaluated, and B - A."""
    a, b = runs
    head = f"{'metric':<22} {'step':>8} {a.label[:16]:>16} {b.label[:16]:>16} {'B - A':>10}"
    lines = [head, "-" * len(head)]
    for name in metric_names(runs):
        sa, sb = a.series.get(name, {}), b.series.get(name, {})
        common = sorted(set(sa) & set(sb))
        if common:
            step = common[-1]
            va, vb = sa[step], sb[step]
            diff = f"{vb - va:+10.4g}"
        else:
            step = max([*sa, *sb])
            va, vb, diff = sa.get(step, math.nan), sb.get(step, math.nan), f"{'-':>10}"
        lines.append(f"{name:<22} {step:>8} {va:>16.5g} {vb:>16.5g} {diff}")
    return "\n".join(lines)


def plot(runs: list[RunMetrics], out: str | Path) -> Path:
    """One subplot per metric, one line per run, batches on x; saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = metric_names(runs)
    cols = min(3, max(1, len(names)))
    rows = math.ceil(len(names) / cols)
    grids = [last_grid(r.folder) for r in runs]
    extra = 1 if any(g is not None for g in grids) else 0
    fig = plt.figure(figsize=(4.5 * cols, 3.2 * rows + 3.6 * extra))
    spec = fig.add_gridspec(rows + extra, cols * 2)
    axes = np.array(
        [[fig.add_subplot(spec[r, 2 * c : 2 * c + 2]) for c in range(cols)] for r in range(rows)]
    )
    if extra:  # the last sample grid of each run, side by side under the plots
        for i, (run, grid) in enumerate(zip(runs, grids, strict=True)):
            ax = fig.add_subplot(spec[rows, i * cols : (i + 1) * cols])
            ax.axis("off")
            if grid is None:
                ax.set_title(f"{run.label}: no sample grid", fontsize=9)
                continue
            from PIL import Image

            with Image.open(grid) as im:
                ax.imshow(np.asarray(im.convert("RGB")))
            ax.set_title(f"{run.label}: {grid.name}", fontsize=9)
    for ax, name in zip(axes.flat, names, strict=False):
        for run in runs:
            pts = sorted(run.series.get(name, {}).items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run.label)
        ax.set_title(name)
        ax.set_xlabel("batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def last_grid(metrics_folder: Path) -> Path | None:
    """The run's latest sample grid (``samples/ba*.png`` of the run folder), if it has one."""
    for base in (metrics_folder, *metrics_folder.parents[:3]):
        found = sorted((base / "samples").glob("ba*.png"))
        if found:
            return found[-1]
    return None


def compare(run_a: str, run_b: str, out: str | Path, labels=(None, None)) -> tuple[Path, str]:
    runs = [load_run(run_a, labels[0]), load_run(run_b, labels[1])]
    if runs[0].label == runs[1].label:
        runs = [
            RunMetrics("A: " + r.label, r.folder, r.series)
            if i == 0
            else RunMetrics("B: " + r.label, r.folder, r.series)
            for i, r in enumerate(runs)
        ]
    return plot(runs, out), table(runs)
