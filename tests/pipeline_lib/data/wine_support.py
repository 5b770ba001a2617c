"""The wine table (scikit-learn's bundled copy) as a CSV a new user might bring: mixed scales, missing cells, a
string feature and a string label; the test decides what to inject."""

from __future__ import annotations

import numpy as np

WINE_CLASSES = ("barbera", "barolo", "grignolino")  # sklearn's class_2, class_0, class_1 by name order
_CLASS_NAME = {0: "barolo", 1: "grignolino", 2: "barbera"}


def wine_frame():
    from sklearn.datasets import load_wine

    data = load_wine()
    names = [n.replace("/", "_") for n in data.feature_names]
    return data.data.astype(np.float64), data.target, names


def write_wine_csv(path, *, missing_rate: float = 0.05, scale: dict[str, float] | None = None,
                   new_category_share: float = 0.0, missing_labels: int = 0, seed: int = 0,
                   rename: dict[str, str] | None = None) -> str:
    """Write the wine rows with a `cellar` string column (from color intensity, with a little noise) and the
    class name as `cultivar`. `missing_rate` of the numeric cells and of the cellar cells are left empty;
    `scale` multiplies columns (a change of units); `new_category_share` of the rows get the cellar value
    "annex", never seen before; `missing_labels` rows have an empty label; `rename` gives columns (the label
    too) other names in the header (old name → new)."""
    values, target, names = wine_frame()
    rng = np.random.default_rng(seed)
    values = values.copy()
    for name, factor in (scale or {}).items():
        values[:, names.index(name)] *= factor
    color = values[:, names.index("color_intensity")] / (scale or {}).get("color_intensity", 1.0)
    cellar = np.where(color < 3.5, "north", np.where(color < 6.0, "south", "east")).astype(object)
    flip = rng.random(len(cellar)) < 0.1
    cellar[flip] = rng.choice(["north", "south", "east"], size=int(flip.sum()))
    if new_category_share:
        cellar[rng.random(len(cellar)) < new_category_share] = "annex"
    missing = rng.random(values.shape) < missing_rate
    cellar_missing = rng.random(len(cellar)) < missing_rate
    label_missing = set(rng.choice(len(target), size=missing_labels, replace=False).tolist())
    lines = [",".join((rename or {}).get(n, n) for n in [*names, "cellar", "cultivar"])]
    for i in range(len(target)):
        cells = ["" if missing[i, j] else repr(float(values[i, j])) for j in range(len(names))]
        cells.append("" if cellar_missing[i] else cellar[i])
        cells.append("" if i in label_missing else _CLASS_NAME[int(target[i])])
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n")
    return str(path)
