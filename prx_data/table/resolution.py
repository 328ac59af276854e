"""``python -m prx_data.stats --table URI --out DIR``: what an export would make of a table.

Reads only the ``width``/``height``/``probe_error`` columns, buckets every
row with :func:`prx_data.core.buckets.assign_bucket` and reports the resolution,
aspect-ratio and tier distributions with would-be drop counts, plus fragment
hygiene (count and sizes). Writes PNG plots and ``stats.json`` to DIR and
prints a table. This is what set the PRX team's 384x384 floor.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from prx_data.core import schema as S
from prx_data.core.buckets import DEFAULT_SPEC, BucketSpec, assign_bucket
from prx_data.table import lance_ops as T

STATS_NAME = "stats.json"
UNREADABLE = "unreadable"


@dataclass
class TableReport:
    """Distributions over the rows of a table (JSON-able)."""

    rows: int
    tiers: dict[str, int]  # tier -> rows that would be exported to it
    buckets: dict[str, int]  # "tier/ar" -> rows
    drops: dict[str, int]  # reason -> rows an export would drop
    megapixels: dict[str, list[float]]  # histogram: edges, counts
    aspect_ratio: dict[str, list[float]]  # histogram of log2(w/h): edges, counts
    short_side: dict[str, float]  # percentiles of min(w, h)
    fragments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sizes(uri: str, storage_options: dict | None) -> tuple[np.ndarray, np.ndarray, int]:
    ds = T.open_table(uri, storage_options)
    cols = [S.WIDTH, S.HEIGHT] + ([S.PROBE_ERROR] if S.PROBE_ERROR in ds.schema.names else [])
    t = ds.to_table(columns=cols)
    w = t[S.WIDTH].to_numpy(zero_copy_only=False)
    h = t[S.HEIGHT].to_numpy(zero_copy_only=False)
    w = np.nan_to_num(np.asarray(w, dtype=np.float64), nan=0).astype(np.int64)
    h = np.nan_to_num(np.asarray(h, dtype=np.float64), nan=0).astype(np.int64)
    ok = (w > 0) & (h > 0)
    if S.PROBE_ERROR in t.column_names:
        ok &= ~np.asarray(t[S.PROBE_ERROR].is_valid().to_numpy(zero_copy_only=False))
    unreadable = int((~ok).sum())
    return w[ok], h[ok], unreadable


def compute(
    uri: str, spec: BucketSpec = DEFAULT_SPEC, storage_options: dict | None = None
) -> TableReport:
    """Bucket every readable row; count drops by reason (``unreadable`` for probe errors)."""
    w, h, unreadable = _sizes(uri, storage_options)
    tiers: Counter = Counter()
    buckets: Counter = Counter()
    drops: Counter = Counter()
    if unreadable:
        drops[UNREADABLE] = unreadable
    if len(w):
        # Bucket each distinct size once: real tables repeat sizes a lot.
        pairs, counts = np.unique(np.stack([w, h], axis=1), axis=0, return_counts=True)
        for (pw, ph), n in zip(pairs.tolist(), counts.tolist(), strict=True):
            a = assign_bucket(pw, ph, spec)
            if a.bucket is None:
                drops[a.reason] += n
            else:
                tiers[str(a.bucket.tier)] += n
                buckets[a.bucket.name] += n
    mp = (w * h) / 1e6 if len(w) else np.zeros(0)
    mp_edges = np.geomspace(0.01, max(100.0, float(mp.max()) if len(mp) else 1.0), 41)
    mp_counts, _ = np.histogram(np.clip(mp, mp_edges[0], mp_edges[-1]), bins=mp_edges)
    lr = np.log2(w / h) if len(w) else np.zeros(0)
    ar_edges = np.linspace(-3, 3, 61)
    ar_counts, _ = np.histogram(np.clip(lr, -3, 3), bins=ar_edges)
    short = np.minimum(w, h) if len(w) else np.zeros(1)
    pct = {f"p{p}": float(np.percentile(short, p)) for p in (1, 5, 25, 50, 75, 95, 99)}
    return TableReport(
        rows=int(len(w) + unreadable),
        tiers=dict(sorted(tiers.items(), key=lambda kv: int(kv[0]))),
        buckets=dict(sorted(buckets.items())),
        drops=dict(sorted(drops.items())),
        megapixels={"edges": mp_edges.tolist(), "counts": mp_counts.tolist()},
        aspect_ratio={"log2_edges": ar_edges.tolist(), "counts": ar_counts.tolist()},
        short_side=pct,
        fragments=T.table_stats(uri, storage_options),
    )


def plot(report: TableReport, out_dir: str, spec: BucketSpec = DEFAULT_SPEC) -> list[str]:
    """Write resolution, aspect-ratio, tier and fragment plots as PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    edges = np.array(report.megapixels["edges"])
    ax.bar(
        edges[:-1], report.megapixels["counts"], width=np.diff(edges), align="edge", color="#4c78a8"
    )
    ax.set_xscale("log")
    for t in spec.tiers:
        ax.axvline(spec.floor_pixels(t) / 1e6, color="#e45756", ls="--", lw=1)
        ax.text(
            spec.floor_pixels(t) / 1e6, ax.get_ylim()[1] * 0.95, f" {t}", color="#e45756", va="top"
        )
    ax.set_xlabel("megapixels (dashed: tier floors, (tier*3/4)^2)")
    ax.set_ylabel("images")
    ax.set_title("Resolution")
    paths.append(_save(fig, out_dir, "resolution.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    e = np.array(report.aspect_ratio["log2_edges"])
    ax.bar(
        2.0 ** e[:-1],
        report.aspect_ratio["counts"],
        width=np.diff(2.0**e),
        align="edge",
        color="#72b7b2",
    )
    ax.set_xscale("log", base=2)
    for x in (spec.min_aspect, spec.max_aspect):
        ax.axvline(x, color="#e45756", ls="--", lw=1)
    for w, h in spec.shapes(spec.tiers[0]):
        ax.axvline(w / h, color="#999999", lw=0.5)
    ax.set_xlabel("aspect ratio w/h (grey: bucket shapes, dashed: kept range)")
    ax.set_ylabel("images")
    ax.set_title("Aspect ratio")
    paths.append(_save(fig, out_dir, "aspect_ratio.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = list(report.tiers) + [f"drop:{k}" for k in report.drops]
    values = list(report.tiers.values()) + list(report.drops.values())
    colors = ["#4c78a8"] * len(report.tiers) + ["#e45756"] * len(report.drops)
    ax.bar(labels, values, color=colors)
    ax.set_ylabel("images")
    ax.set_title("Tiers and would-be drops")
    ax.tick_params(axis="x", rotation=30)
    paths.append(_save(fig, out_dir, "tiers.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    sizes = report.fragments.get("fragment_sizes", [])
    ax.bar(range(len(sizes)), [s["rows"] for s in sizes], color="#54a24b")
    ax.set_xlabel("fragment")
    ax.set_ylabel("rows")
    ax.set_title(f"{len(sizes)} fragments")
    paths.append(_save(fig, out_dir, "fragments.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_report(report: TableReport) -> str:
    n = max(report.rows, 1)
    lines = [f"rows {report.rows:,}", "", f"{'tier':<16}{'rows':>12}{'share':>9}"]
    for tier, c in report.tiers.items():
        lines.append(f"{tier:<16}{c:>12,}{c / n:>9.1%}")
    for reason, c in report.drops.items():
        lines.append(f"{'drop:' + reason:<16}{c:>12,}{c / n:>9.1%}")
    lines += ["", f"{'bucket':<16}{'rows':>12}"]
    lines += [f"{b:<16}{c:>12,}" for b, c in report.buckets.items()]
    ss = report.short_side
    lines += [
        "",
        "short side px    " + "  ".join(f"{k} {v:,.0f}" for k, v in ss.items()),
        "",
        T.format_stats(report.fragments),
    ]
    return "\n".join(lines)


def run(uri: str, out_dir: str, spec: BucketSpec = DEFAULT_SPEC) -> TableReport:
    """Compute, plot, write ``stats.json``; returns the report."""
    report = compute(uri, spec)
    plot(report, out_dir, spec)
    with open(os.path.join(out_dir, STATS_NAME), "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=2, default=str)
    return report
