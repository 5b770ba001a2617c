"""Tests for pipeline_lib.data.statistics_report: the histogram pictures (SVG) and their counts."""

from __future__ import annotations

from xml.etree import ElementTree

import numpy as np
import pyarrow as pa

from pipeline_lib.data.accumulators import NumericAccumulator, StringAccumulator
from pipeline_lib.data.schema import DType
from pipeline_lib.data.statistics import FeatureStatistics
from pipeline_lib.data.statistics_report import (
    NUM_HISTOGRAM_BINS,
    histogram_counts,
    histogram_svg,
)

SVG = "{http://www.w3.org/2000/svg}"


def _numeric(values: np.ndarray) -> FeatureStatistics:
    accumulator = NumericAccumulator()
    accumulator.add(values)
    return FeatureStatistics(dtype=DType.FLOAT32, numeric=accumulator.result())


def _bars(svg: str) -> list[ElementTree.Element]:
    return [e for e in ElementTree.fromstring(svg).iter(f"{SVG}rect") if e.get("class") == "bar"]


def test_numeric_histogram_counts_equal_numpys_on_values_the_sketch_keeps_exactly():
    # Small integers are exact in the sketch (5 mantissa bits), as the digits' pixel values are.
    values = np.random.default_rng(0).integers(0, 17, size=5_000).astype(np.float32)
    values[::50] = np.nan
    feature = _numeric(values)
    edges, counts = histogram_counts(feature)
    present = values[~np.isnan(values)]
    expected, expected_edges = np.histogram(present, bins=NUM_HISTOGRAM_BINS, range=(0, 16))
    assert counts == expected.tolist() and np.allclose(edges, expected_edges)
    assert sum(counts) == feature.count == present.size


def test_numeric_histogram_of_spread_values_keeps_every_row_and_its_shape():
    values = np.random.default_rng(1).normal(100.0, 15.0, size=20_000).astype(np.float32)
    _edges, counts = histogram_counts(_numeric(values))
    expected, _ = np.histogram(values, bins=NUM_HISTOGRAM_BINS, range=(values.min(), values.max()))
    assert sum(counts) == values.size
    # Each sketch bucket is about 3 % wide, so a value can land one bin over; the shape is the same.
    assert np.abs(np.array(counts) - expected).sum() < 0.1 * values.size
    assert int(np.argmax(counts)) in range(int(np.argmax(expected)) - 1, int(np.argmax(expected)) + 2)


def test_numeric_svg_draws_one_bar_per_bin_scaled_to_its_count():
    values = np.random.default_rng(2).integers(0, 17, size=1_000).astype(np.float32)
    feature = _numeric(values)
    svg = histogram_svg("pixel <3 & 4>", feature)
    root = ElementTree.fromstring(svg)  # well-formed: the name is escaped
    texts = [e.text for e in root.iter(f"{SVG}text")]
    assert "pixel <3 & 4>: 1000 values, 0 missing" in texts
    bars = _bars(svg)
    _edges, counts = histogram_counts(feature)
    assert [int(b.get("data-count")) for b in bars] == counts and len(bars) == NUM_HISTOGRAM_BINS
    heights = np.array([float(b.get("height")) for b in bars])
    assert np.allclose(heights / heights.max(), np.array(counts) / max(counts), atol=0.01)


def test_string_svg_draws_the_top_values_and_a_column_without_values_draws_nothing():
    accumulator = StringAccumulator()
    accumulator.add(pa.array([b"red"] * 5 + [b"green"] * 3 + [b"blue"] + [b""] * 2, pa.binary()))
    feature = FeatureStatistics(dtype=DType.STRING, string=accumulator.result())
    svg = histogram_svg("colour", feature)
    assert [int(b.get("data-count")) for b in _bars(svg)] == [5, 3, 1]
    assert {"red", "green", "blue"} <= {e.text for e in ElementTree.fromstring(svg).iter(f"{SVG}text")}
    empty = NumericAccumulator()
    empty.add(np.array([np.nan, np.nan], dtype=np.float32))
    assert histogram_svg("gone", FeatureStatistics(dtype=DType.FLOAT32, numeric=empty.result())) is None
