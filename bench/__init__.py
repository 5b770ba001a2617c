"""Benchmarks for `make bench`: each case measured against its baseline in the same run."""


def case(name: str, value: float, baseline: float, target: float, *, higher_is_better: bool = True) -> dict:
    """One comparison; for lower-is-better cases the ratio is baseline/value so ≥ target still means good."""
    ratio = value / baseline if higher_is_better else baseline / value
    return {"name": name, "value": float(value), "baseline": float(baseline), "ratio": float(ratio),
            "target": float(target), "met": bool(ratio >= target)}
