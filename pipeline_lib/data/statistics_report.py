"""Statistics a person can read: a table per split (feature, type, count, missing %, min, mean, max, top values)
and a histogram image (SVG) per feature."""

from __future__ import annotations

from xml.sax.saxutils import escape

from pipeline_lib.data.statistics import (
    DatasetStatistics,
    FeatureStatistics,
    bucket_start,
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


def histogram_counts(feature: FeatureStatistics) -> tuple[list[float], list[int]] | None:
    """A numeric feature's histogram from its sketch: NUM_HISTOGRAM_BINS + 1 equal-width edges from min to max
    and the rows in each bin (each sketch bucket counted at its end nearest zero, so values the sketch keeps
    exactly land in numpy's bin); None without values."""
    n = feature.numeric
    if n is None or not n.count:
        return None
    low, high = n.min, n.max
    if not high > low:
        return [low, low], [n.count]
    width = (high - low) / NUM_HISTOGRAM_BINS
    counts = [0] * NUM_HISTOGRAM_BINS
    for key, count in n.sketch.items():
        index = int((bucket_start(key) - low) / width)
        counts[min(max(index, 0), NUM_HISTOGRAM_BINS - 1)] += count
    return [low + i * width for i in range(NUM_HISTOGRAM_BINS)] + [high], counts


# The picture: a 400 x 240 SVG (MLflow's artifact view shows .svg as an image), drawn as text: no plotting
# library to import and nothing to rasterize, so every feature of a wide table costs about a millisecond.
_WIDTH, _HEIGHT = 400, 240
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 390, 30, 200
_FONT = 'font-family="sans-serif" font-size="11"'


def _svg(title: str, body: list[str]) -> str:
    return "\n".join([
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
         f'viewBox="0 0 {_WIDTH} {_HEIGHT}">'),
        f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
        f'<text x="{_WIDTH / 2}" y="18" text-anchor="middle" {_FONT} font-weight="bold">{escape(title)}</text>',
        *body,
        f'<line x1="{_LEFT}" y1="{_BOTTOM}" x2="{_RIGHT}" y2="{_BOTTOM}" stroke="black"/>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_BOTTOM}" stroke="black"/>',
        "</svg>\n"])


def histogram_svg(name: str, feature: FeatureStatistics) -> str | None:
    """An SVG of a numeric feature's distribution (from its sketch) or a string feature's top values; None for
    a column without values."""
    title = f"{name}: {feature.count} values, {feature.missing} missing"
    body = []
    if feature.numeric is not None:
        histogram = histogram_counts(feature)
        if histogram is None:
            return None
        edges, counts = histogram
        tallest = max(counts) or 1
        bar = (_RIGHT - _LEFT) / len(counts)
        for i, count in enumerate(counts):
            height = (_BOTTOM - _TOP) * count / tallest
            body.append(f'<rect class="bar" data-count="{count}" x="{_LEFT + i * bar:.1f}" '
                        f'y="{_BOTTOM - height:.1f}" width="{bar * 0.9:.1f}" height="{height:.1f}" fill="#4878a8"/>')
        body += [f'<text x="{_LEFT}" y="{_BOTTOM + 15}" text-anchor="middle" {_FONT}>{_number(edges[0])}</text>',
                 f'<text x="{_RIGHT}" y="{_BOTTOM + 15}" text-anchor="middle" {_FONT}>{_number(edges[-1])}</text>',
                 (f'<text x="{(_LEFT + _RIGHT) / 2}" y="{_BOTTOM + 32}" text-anchor="middle" {_FONT}>'
                  f'{escape(name)}</text>'),
                 f'<text x="{_LEFT - 4}" y="{_TOP + 4}" text-anchor="end" {_FONT}>{tallest}</text>',
                 f'<text x="{_LEFT - 4}" y="{_BOTTOM}" text-anchor="end" {_FONT}>0</text>']
    else:
        top = feature.string.top(15)
        if not top:
            return None
        tallest = top[0][1] or 1
        row = (_BOTTOM - _TOP) / len(top)
        for i, (value, count) in enumerate(top):
            y = _TOP + i * row
            length = (_RIGHT - _LEFT) * count / tallest
            label = value if len(value) <= 12 else value[:11] + "…"
            body += [(f'<rect class="bar" data-count="{count}" x="{_LEFT}" y="{y:.1f}" width="{length:.1f}" '
                      f'height="{row * 0.8:.1f}" fill="#4878a8"/>'),
                     f'<text x="{_LEFT - 4}" y="{y + row * 0.6:.1f}" text-anchor="end" {_FONT}>{escape(label)}</text>']
        body += [f'<text x="{_RIGHT}" y="{_BOTTOM + 15}" text-anchor="end" {_FONT}>{tallest} rows</text>']
    return _svg(title, body)


def histogram_artifacts(statistics: DatasetStatistics, split: str = "train") -> dict[str, str]:
    """`data/histograms/<feature>.svg` for every column of the split that has values."""
    out = {}
    for name, feature in statistics.splits[split].features.items():
        svg = histogram_svg(name, feature)
        if svg is not None:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            out[f"data/histograms/{safe}.svg"] = svg
    return out
