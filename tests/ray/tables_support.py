"""What the Ray data-path tests share: the CSV tables they convert and score (a string label, a float with gaps, an
int and a string with gaps, with bad values where a test wants them), and a node lost mid-way through their work."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

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


def lose_the_node_mid_way(ray_cluster, group: str, work: Callable[[dict[str, float]], Any],
                          started: Callable[[], bool], timeout_s: float = 300) -> tuple[Any, str]:
    """Run `work(resources)` on a thread, on one node of its own (`resources` ask for it); once `started()`, SIGKILL
    that node's raylet and workers, as a lost machine, and add another node of the group.

    Returns:
        what `work` returned, and the new node's id (the lost work has to be redone there).
    """
    with ray_cluster.nodes_of_their_own(group, 1) as added:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = work({"CPU": 1.0, group: 1.0})
            except BaseException as error:  # noqa: BLE001 - re-raised below
                outcome["error"] = error

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 180
        while not started():
            assert thread.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.02)
        raylet = psutil.Process(ray_cluster.raylet_pid(added[0]))
        for process in [raylet, *raylet.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        ray_cluster.forget_node(added[0])
        added.append(ray_cluster.add_node(f"{group}_b", {group: 1}))
        thread.join(timeout=timeout_s)
        assert not thread.is_alive(), "the work did not finish after its node was lost"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], added[1]
