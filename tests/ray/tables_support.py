"""The tables the Ray data-path tests convert and score: CSV files of a string label, a float with gaps, an int and
a string with gaps, with bad values where a test wants them."""

from __future__ import annotations

import random

SPECIES = ("setosa", "versicolor", "virginica")


def write_csvs(folder, files: int, rows: int, *, bad: dict[int, int] | None = None) -> str:
    """`files` CSVs of `rows` rows (string label, a float with gaps, an int, a string with gaps); `bad` maps a file
    to a line whose float is not a number."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    for number in range(files):
        lines = ["x,n,tag,species"]
        for row in range(rows):
            x = "" if rng.random() < 0.03 else f"{rng.gauss(5, 2):.4f}"
            if bad and bad.get(number) == row + 2:
                x = "abc"
            tag = rng.choice(["a", "b", "", "c"])
            lines.append(f"{x},{rng.randint(-50, 50)},{tag},{rng.choice(SPECIES)}")
        (folder / f"part{number}.csv").write_text("\n".join(lines) + "\n")
    return str(folder / "*.csv")
