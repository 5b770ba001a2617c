"""Statistics a person can read: a table per split (feature, type, count, missing %, min, mean, max, top values)
and a histogram image per feature."""

from __future__ import annotations

import io

from pipeline_lib.data.statistics import (
    DatasetStatistics,
    FeatureStatistics,
    bucket_value,
)

NUM_HISTOGRAM_BINS = 30


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def table_rows(statistics: DatasetStatistics, split: str) -> list[dict[str, str | int]]:
    """One row per column of the split: feature, type, count, missing %, min, mean, max, top values."""
    rows = []
    for name, feature in statistics.splits[split].features.items():
        row: dict[str, str | int] = {"feature": name + (" (label)" if name == statistics.label else ""),
                                     "type": feature.dtype.value, "count": feature.count,
                                     "missing %": f"{100 * feature.missing_rate:.1f}"}
        if feature.numeric is not None:
            n = feature.numeric
            row.update({"min": _number(n.min), "mean": _number(n.mean), "max": _number(n.max), "top values": ""})
        else:
            top = ", ".join(f"{v} ({c})" for v, c in feature.string.top(5))
            row.update({"min": "", "mean": "", "max": "",
                        "top values": f"{feature.string.distinct} distinct: {top}"})
        rows.append(row)
    return rows


def to_markdown(statistics: DatasetStatistics) -> str:
    """Every split's table, in Markdown."""
    parts = ["# Data statistics\n"]
    for split, stats in statistics.splits.items():
        rows = table_rows(statistics, split)
        parts.append(f"## {split} ({stats.num_rows} rows)\n")
        if not rows:
            continue
        header = list(rows[0])
        parts.append("| " + " | ".join(header) + " |")
        parts.append("|" + "---|" * len(header))
        parts += ["| " + " | ".join(str(r[h]).replace("|", "\\|") for h in header) + " |" for r in rows]
        parts.append("")
    return "\n".join(parts) + "\n"


def histogram_png(name: str, feature: FeatureStatistics) -> bytes | None:
    """A PNG of a numeric feature's distribution (from its sketch) or a string feature's top values."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3))
    try:
        if feature.numeric is not None:
            n = feature.numeric
            if not n.count:
                return None
            values = [bucket_value(k) for k in n.sketch]
            weights = list(n.sketch.values())
            axes.hist(values, bins=NUM_HISTOGRAM_BINS, weights=weights, range=(n.min, n.max) if n.max > n.min else None)
            axes.set_xlabel(name)
        else:
            top = feature.string.top(15)
            if not top:
                return None
            axes.barh([v for v, _ in reversed(top)], [c for _, c in reversed(top)])
            axes.set_xlabel("rows")
        axes.set_title(f"{name}: {feature.count} values, {feature.missing} missing")
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=80)
        return buffer.getvalue()
    finally:
        plt.close(figure)


def histogram_artifacts(statistics: DatasetStatistics, split: str = "train") -> dict[str, bytes]:
    """`data/histograms/<feature>.png` for every column of the split."""
    out = {}
    for name, feature in statistics.splits[split].features.items():
        png = histogram_png(name, feature)
        if png is not None:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            out[f"data/histograms/{safe}.png"] = png
    return out
