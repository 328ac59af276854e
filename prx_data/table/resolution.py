"""``python -m prx_data.stats --table URI --out DIR``: what an export would make of a table.

Reads only the ``width``/``height``/``probe_error`` columns (and
``image_quality`` when present), buckets every row with
:func:`prx_data.core.buckets.assign_bucket` and reports the resolution,
aspect-ratio and tier distributions with would-be drop counts, the
image-quality distribution with the low-information count, plus fragment
hygiene (count, rows and bytes). Writes PNG plots and ``stats.json`` to DIR and
prints a table. This is what set the PRX team's 384x384 floor.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from prx_data.core import quality as Q
from prx_data.core import schema as S
from prx_data.core.buckets import DEFAULT_SPEC, BucketSpec, assign_bucket
from prx_data.core.errors import UsageError
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
    #: Image-quality distribution when the table has the column (see prx_data.core.quality).
    quality: dict[str, Any] = field(default_factory=dict)
    #: Per numeric column (:func:`numeric_columns`: scores, quality fields, ...): a histogram,
    #: percentiles and, for ``--mark`` thresholds, the rows above and below.
    scores: dict[str, Any] = field(default_factory=dict)

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
    uri: str,
    spec: BucketSpec = DEFAULT_SPEC,
    storage_options: dict | None = None,
    marks: dict[str, list[float]] | None = None,
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
    mp_edges = _mp_edges(mp)
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
        quality=quality_summary(uri, storage_options),
        scores=score_summary(uri, storage_options, marks=marks),
    )


def numeric_columns(schema: pa.Schema) -> list[str]:
    """Every floating-point column and struct field (``image_quality.std``), from the schema.

    The score jobs' outputs (``clip_score``, ``aesthetic_score``,
    ``watermark_p_<class>``), image-quality measures, numeric attributes and
    any float a user added: the columns stats plots and the explorer filters
    and sorts by. Fields of a struct are named ``<column>.<field>`` (one level),
    as Lance SQL reads them.
    """
    out: list[str] = []
    for f in schema:
        if pa.types.is_floating(f.type):
            out.append(f.name)
        elif pa.types.is_struct(f.type):
            out += [
                f"{f.name}.{c.name}"
                for c in (f.type.field(i) for i in range(f.type.num_fields))
                if pa.types.is_floating(c.type) and "." not in c.name
            ]
    return out


def column_sql(name: str) -> str:
    """A column or ``struct.field`` name from :func:`numeric_columns`, quoted for Lance SQL."""
    return ".".join(T.quote(part) for part in name.split(".", 1))


def _is_probability(name: str) -> bool:
    return "_p_" in name.rsplit(".", 1)[-1]


def parse_marks(specs: list[str] | tuple[str, ...], columns: list[str]) -> dict[str, list[float]]:
    """``["aesthetic=5", "clip_score=0.25"]`` -> {column: [thresholds]}.

    A name matches a column exactly, else ``<name>_score`` (``aesthetic`` ->
    ``aesthetic_score``). Anything else is a ValueError naming the columns.
    """
    marks: dict[str, list[float]] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        try:
            t = float(value)
        except ValueError:
            t = float("nan")
        if not sep or t != t or t in (float("inf"), float("-inf")):
            raise UsageError(f"--mark takes COLUMN=NUMBER (e.g. aesthetic_score=5), got {spec!r}")
        col = name if name in columns else f"{name}_score"
        if col not in columns:
            raise UsageError(
                f"--mark {spec!r}: no numeric column {name!r}; the table has: "
                + (", ".join(columns) or "none")
            )
        marks.setdefault(col, []).append(t)
    return marks


def score_summary(
    uri: str,
    storage_options: dict | None = None,
    bins: int = 40,
    marks: dict[str, list[float]] | None = None,
) -> dict:
    """A histogram, percentiles and the share at each marked threshold per numeric column.

    Streamed one column at a time (float32 values, the column alone in memory).
    ``marks`` ({column: [thresholds]}) adds, per threshold, the exact count of
    rows ``>=`` and ``<`` it among the scored rows.
    """
    ds = T.open_table(uri, storage_options)
    marks = marks or {}
    out: dict[str, Any] = {}
    for name in numeric_columns(ds.schema):
        parts = [
            b.column(0).drop_null().to_numpy(zero_copy_only=False).astype(np.float32)
            for b in ds.scanner(columns={"v": name}, batch_size=1 << 16).to_batches()
        ]
        v = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        v = v[np.isfinite(v)]
        if _is_probability(name):
            edges = np.linspace(0.0, 1.0, bins + 1)
        elif len(v):
            lo, hi = float(v.min()), float(v.max())
            edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
        else:
            edges = np.linspace(0.0, 1.0, bins + 1)
        counts, _ = np.histogram(np.clip(v, edges[0], edges[-1]), bins=edges)
        entry: dict[str, Any] = {
            "scored": int(len(v)),
            "edges": edges.tolist(),
            "counts": counts.tolist(),
            "percentiles": {f"p{p}": float(np.percentile(v, p)) for p in (1, 10, 50, 90, 99)}
            if len(v)
            else {},
        }
        if name in marks:
            entry["marks"] = []
            for t in marks[name]:
                above = int((v >= np.float32(t)).sum())
                entry["marks"].append(
                    {
                        "threshold": t,
                        "above": above,
                        "below": int(len(v)) - above,
                        "share_above": above / len(v) if len(v) else 0.0,
                    }
                )
        out[name] = entry
    return out


def _mp_edges(mp: np.ndarray, bins: int = 40) -> np.ndarray:
    """Log-spaced megapixel bins fitted to the data (padded a little), not a fixed 0.01-100."""
    if not len(mp):
        return np.geomspace(0.1, 10.0, bins + 1)
    lo, hi = float(mp.min()), float(mp.max())
    lo, hi = max(lo / 1.25, 1e-4), hi * 1.25
    if hi / lo < 4:  # a narrow spread still gets a readable span
        mid = np.sqrt(lo * hi)
        lo, hi = mid / 2, mid * 2
    return np.geomspace(lo, hi, bins + 1)


def quality_summary(uri: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Distribution of the image-quality column and the low-information count ({} without it)."""
    ds = T.open_table(uri, storage_options)
    if Q.COLUMN not in ds.schema.names:
        return {}
    col = ds.to_table(columns=[Q.COLUMN])[Q.COLUMN].combine_chunks()
    if isinstance(col, pa.ExtensionArray):  # pragma: no cover - defensive
        col = col.storage
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    vals = {f: col.field(f).to_numpy(zero_copy_only=False)[valid] for f in Q.FIELDS}
    low = Q.is_low_information(vals["std"], vals["entropy"], vals["flat"])
    std_edges = np.linspace(0.0, 128.0, 65)
    std_counts, _ = np.histogram(np.clip(vals["std"], 0, 128), bins=std_edges)
    ent_edges = np.linspace(0.0, 8.0, 33)
    ent_counts, _ = np.histogram(np.clip(vals["entropy"], 0, 8), bins=ent_edges)
    return {
        "column": Q.COLUMN,
        "measured": int(valid.sum()),
        "not_measured": int((~valid).sum()),
        "low_information": int(low.sum()),
        "blank_std": int((vals["std"] < Q.BLANK_STD).sum()),
        "low_information_filter": Q.LOW_INFORMATION_SQL,
        "std": {"edges": std_edges.tolist(), "counts": std_counts.tolist()},
        "entropy": {"edges": ent_edges.tolist(), "counts": ent_counts.tolist()},
    }


def plot(report: TableReport, out_dir: str, spec: BucketSpec = DEFAULT_SPEC) -> list[str]:
    """Write resolution, aspect-ratio, tier and fragment plots as PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    edges = np.array(report.megapixels["edges"])
    ax.bar(
        edges[:-1], report.megapixels["counts"], width=np.diff(edges), align="edge", color="#4c78a8"
    )
    ax.set_xscale("log")
    ax.set_xlim(edges[0], edges[-1])
    top = max(report.megapixels["counts"] or [0]) or 1
    ax.set_ylim(0, top * 1.18)
    for t in spec.tiers:
        x = spec.floor_pixels(t) / 1e6
        if edges[0] <= x <= edges[-1]:
            ax.axvline(x, color="#e45756", ls="--", lw=1)
            ax.text(x, top * 1.15, f" {t} tier", color="#e45756", va="top", fontsize=9)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_mp_label))
    ax.set_xlabel("megapixels (dashed: tier floors, (tier*3/4)^2 pixels)")
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

    sizes = report.fragments.get("fragment_sizes", [])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    xs = np.arange(len(sizes))
    ax.bar(xs, [s["rows"] for s in sizes], color="#54a24b")
    bx.bar(xs, [s["bytes"] / 1e6 for s in sizes], color="#f58518")
    for a, what in ((ax, "rows"), (bx, "MB")):
        a.set_xlabel("fragment")
        a.set_ylabel(what)
        a.set_title(f"{what} per fragment")
        a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True, nbins=10))
        if len(sizes) == 1:
            a.set_xticks([0])
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    total = report.fragments.get("fragment_bytes", {}).get("total", 0) / 1e6
    fig.suptitle(f"{len(sizes)} fragment{'' if len(sizes) == 1 else 's'}, {total:,.1f} MB")
    paths.append(_save(fig, out_dir, "fragments.png"))

    if report.quality:
        q = report.quality
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
        e = np.array(q["std"]["edges"])
        ax.bar(e[:-1], q["std"]["counts"], width=np.diff(e), align="edge", color="#4c78a8")
        ax.axvline(Q.BLANK_STD, color="#e45756", ls="--", lw=1)
        ax.set_xlabel(f"pixel std, 0-255 (dashed: blank below {Q.BLANK_STD:g})")
        ax.set_ylabel("images")
        ax.set_yscale("symlog", linthresh=10)
        e = np.array(q["entropy"]["edges"])
        bx.bar(e[:-1], q["entropy"]["counts"], width=np.diff(e), align="edge", color="#72b7b2")
        bx.axvline(Q.BLANK_ENTROPY, color="#e45756", ls="--", lw=1)
        bx.set_xlabel(f"grey-level entropy, bits (dashed: blank below {Q.BLANK_ENTROPY:g})")
        bx.set_yscale("symlog", linthresh=10)
        fig.suptitle(
            f"Image quality: {q['low_information']:,} of {q['measured']:,} measured images "
            "are low-information"
        )
        paths.append(_save(fig, out_dir, "quality.png"))

    if report.scores:
        names = list(report.scores)
        cols = min(3, len(names))
        rows = -(-len(names) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):
            sc = report.scores[name]
            e = np.array(sc["edges"])
            ax.bar(e[:-1], sc["counts"], width=np.diff(e), align="edge", color="#4c78a8")
            ax.set_title(f"{name} ({sc['scored']:,} rows)", fontsize=9)
            ax.set_yscale("symlog", linthresh=10)
            for m in sc.get("marks", []):
                ax.axvline(m["threshold"], color="#e45756", ls="--", lw=1)
                ax.text(
                    m["threshold"],
                    1.0,
                    f" {m['share_above']:.1%} >= {m['threshold']:g}\n"
                    f" {1 - m['share_above']:.1%} below",
                    transform=ax.get_xaxis_transform(),
                    color="#e45756",
                    va="top",
                    fontsize=8,
                )
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        paths.append(_save(fig, out_dir, "scores.png"))
    return paths


def _mp_label(x: float, _pos=None) -> str:
    return f"{x:g}" if x >= 0.01 else f"{x:.0e}"


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
    lines += ["", "short side px    " + "  ".join(f"{k} {v:,.0f}" for k, v in ss.items())]
    q = report.quality
    if q:
        lines += [
            "",
            f"image quality    {q['measured']:,} measured, {q['not_measured']:,} not measured",
            f"  low-information {q['low_information']:,} ({q['blank_std']:,} with std < "
            f'{Q.BLANK_STD:g}); select them with --where "{q["low_information_filter"]}"',
        ]
    else:
        lines += ["", "image quality    not measured (python -m prx_data.quality --table URI)"]
    for name, sc in report.scores.items():
        pct = "  ".join(f"{k} {v:.3g}" for k, v in sc["percentiles"].items())
        lines.append(f"score {name}: {sc['scored']:,} rows  {pct}")
        for m in sc.get("marks", []):
            lines.append(
                f"  >= {m['threshold']:g}: {m['above']:,} ({m['share_above']:.1%}), "
                f"below: {m['below']:,}"
            )
    lines += ["", T.format_stats(report.fragments)]
    return "\n".join(lines)


def run(
    uri: str,
    out_dir: str,
    spec: BucketSpec = DEFAULT_SPEC,
    marks: dict[str, list[float]] | None = None,
) -> TableReport:
    """Compute, plot, write ``stats.json``; returns the report."""
    report = compute(uri, spec, marks=marks)
    plot(report, out_dir, spec)
    with open(os.path.join(out_dir, STATS_NAME), "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=2, default=str)
    return report
