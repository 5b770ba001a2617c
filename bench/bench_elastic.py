"""Elastic training (`train.elastic`): the training a resize loses, and the speed after shrinking.

What is timed, and why it is honest:

* An elastic run of 3 local workers (global batch 75) loses worker 2 to SIGKILL after step 50 with only 2 "nodes"
  left (the local launcher's injected node loss, `pipeline_lib.testing.local_nodes`); it resumes from its step-40
  checkpoint on 2 workers (global batch 74) and trains to step 160.
* Seconds lost per resize: from the kill (the fault's marker file, written just before it fires) to the chief's
  first step on 2 workers, and the steps it trains again (those after the last checkpoint) reported beside it.
* Steps/s after shrinking, against the strongest alternative: a fresh, plain (not elastic) run of 2 workers with
  the same global batch (74) started from scratch, over the same window of steps (61 → 150); its input pipeline is
  the usual one, each worker reading its own share, where the elastic one reads every record and keeps its slice.
  The window starts after the step-60 checkpoint: a process's first checkpoint save (the saver built) costs its
  chief several times the CPU of a later one; the fresh run pays it at step 20, the resumed runs at step 60, so a
  window from step 60 would charge it to the resumed runs only (what looked like more CPU per step for a restarted
  chief). It is reported as its own row, and the workers' CPU per step beside the steps/s.
* Beside it, the same plain 2-worker run with worker 1 SIGKILLed after step 50 and restarted from its step-40
  checkpoint (no elastic, no resize), over the same window: what any restart costs the steps after it.
* The runs alternate for `repeats` rounds; medians and min-max are recorded.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time

from bench import case, interleaved, report

TARGET = 0.95
STEPS, KILL_AFTER, CHECKPOINT_EVERY = 160, 50, 20
FIRST_SAVE = (KILL_AFTER // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY  # the resumed process's first checkpoint: 60
WINDOW = (FIRST_SAVE + 1, 150)  # steady state on every side: past each process's first save and first steps
_STEP = re.compile(r"^\[worker 0\].*train \| step:\s+(\d+)")


def _config(directory: str, raw: str, workers: int, per_replica: int, elastic: bool):
    from pipeline_lib.config import parse_config

    train = {"workers": workers, "per_replica_batch_size": per_replica, "steps": STEPS,
             "checkpoint_every_steps": CHECKPOINT_EVERY, "log_every_steps": 1, "shuffle": True, "seed": 7,
             "base_learning_rate": 0.005, "lr_scaling": "none",
             "restart_backoff_s": 0.1, "hang_timeout_s": 60.0, "max_restarts": 1,
             "early_stopping": {"enabled": False}}
    if elastic:
        train["elastic"] = {"min_workers": 2, "wait_s": 0.5}
    return parse_config({
        "name": "bench-elastic", "data": {"source": raw, "label": "target", "target_shard_mb": 0.1},
        "output_root": os.path.join(directory, "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [64]}},
        "train": train, "tracking": {"enabled": False}, "validation": {"enabled": False},
    })


class _Lines:
    """The launch's output lines with their times, and the CPU seconds of this process's descendants (the workers,
    forked by the fork server) when the chief logs the window's first and last step (the last time, after a
    restart)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.cpu_at: dict[int, dict[int, float]] = {}

    def __call__(self, line: str) -> None:
        self.lines.append((time.time(), line))
        match = _STEP.match(line)
        if match and int(match.group(1)) in WINDOW:
            self.cpu_at[int(match.group(1))] = _cpu_by_process()

    def cpu_ms_per_step(self) -> float:
        """The workers' CPU milliseconds per step over the window, all workers together (it moves less with
        the shared machine's load than steps/s do)."""
        first, last = self.cpu_at[WINDOW[0]], self.cpu_at[WINDOW[1]]
        spent = sum(last[pid] - first[pid] for pid in last if pid in first)
        return spent * 1e3 / (WINDOW[1] - WINDOW[0])

    def steps(self, after: float = 0.0) -> list[tuple[int, float]]:
        """(step, time) of the chief's progress lines logged after `after`."""
        return [(int(m.group(1)), t) for t, line in self.lines if t > after and (m := _STEP.match(line))]


def _cpu_by_process() -> dict[int, float]:
    import psutil

    seconds = {}
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


def _rate(steps: list[tuple[int, float]]) -> float:
    window = [(s, t) for s, t in steps if WINDOW[0] <= s <= WINDOW[1]]
    (first, t0), (last, t1) = window[0], window[-1]
    return (last - first) / (t1 - t0)


def _first_save_extra_s(steps: list[tuple[int, float]]) -> float:
    """How much longer the step after the resumed process's first checkpoint took than the steps after its later
    checkpoints (median), in seconds."""
    at = dict(steps)  # the last time each step was logged

    def after(step: int) -> float:
        return at[step + 1] - at[step]

    return after(FIRST_SAVE) - statistics.median(after(s) for s in range(FIRST_SAVE + CHECKPOINT_EVERY, STEPS,
                                                                          CHECKPOINT_EVERY))


def _train(config, manifest, run_dir: str, lines: _Lines, env: dict[str, str] | None = None):
    from pipeline_lib.launch import launchers
    from pipeline_lib.planning import sharding

    plan = sharding.plan_for_train(manifest, config.train, 1)
    return launchers.launch_training(config, manifest, plan, run_dir,
                                     options=launchers.LaunchOptions(log_fn=lines, env=env))


def _elastic(directory: str, raw: str, manifest, round_: int, cpu: list[float], lost: list[float],
             first_save: list[float]) -> float:
    from pipeline_lib.testing.faults import FAULT_ENV
    from pipeline_lib.testing.local_nodes import local_nodes

    nodes = os.path.join(directory, f"nodes-{round_}")
    with open(nodes, "w") as handle:
        handle.write("2")
    run_dir, lines = os.path.join(directory, f"elastic-{round_}"), _Lines()
    with local_nodes(nodes):
        result = _train(_config(directory, raw, 3, 25, elastic=True), manifest, run_dir, lines,
                        env={FAULT_ENV: f"kill:worker=2:step={KILL_AFTER}"})
    assert [(r.from_workers, r.to_workers) for r in result.resizes] == [(3, 2)] and result.final_step == STEPS
    killed_at = os.path.getmtime(os.path.join(run_dir, ".faults", "kill-worker2"))
    resized_at = next(t for t, line in lines.lines if line.startswith("[supervisor] resize 1:"))
    first_step = min(t for s, t in lines.steps(after=resized_at))
    lost.append(first_step - killed_at)
    first_save.append(_first_save_extra_s(lines.steps(after=resized_at)))
    cpu.append(lines.cpu_ms_per_step())
    return _rate(lines.steps(after=resized_at))


def _fresh(directory: str, raw: str, manifest, round_: int, cpu: list[float]) -> float:
    lines = _Lines()
    _train(_config(directory, raw, 2, 37, elastic=False), manifest, os.path.join(directory, f"fresh-{round_}"), lines)
    cpu.append(lines.cpu_ms_per_step())
    return _rate(lines.steps())


def _restarted(directory: str, raw: str, manifest, round_: int, cpu: list[float]) -> float:
    from pipeline_lib.testing.faults import FAULT_ENV

    lines = _Lines()
    result = _train(_config(directory, raw, 2, 37, elastic=False), manifest,
                    os.path.join(directory, f"restarted-{round_}"), lines,
                    env={FAULT_ENV: f"kill:worker=1:step={KILL_AFTER}"})
    assert result.num_restarts == 1 and result.final_step == STEPS
    restarted_at = next(t for t, line in lines.lines if line.startswith("[supervisor] restart 1:"))
    cpu.append(lines.cpu_ms_per_step())
    return _rate(lines.steps(after=restarted_at))


def run(repeats: int = 3, quick: bool = False) -> list[dict]:
    from pipeline_lib.data import demo
    from pipeline_lib.data.convert import convert
    from pipeline_lib.launch import processes

    repeats = 1 if quick else repeats
    lost: list[float] = []
    first_save: list[float] = []
    cpu: dict[str, list[float]] = {"elastic": [], "fresh": [], "restarted": []}
    with tempfile.TemporaryDirectory() as directory:
        raw = os.path.join(directory, "raw", "digits.csv")
        demo.write_digits_csv(raw)
        config = _config(directory, raw, 3, 25, elastic=True)
        manifest = convert(config.data, config.output_root, config.storage_options)
        processes.warm_fork_server({})
        counter = iter(range(10_000))
        samples = interleaved({
            "elastic": lambda: _elastic(directory, raw, manifest, next(counter), cpu["elastic"], lost, first_save),
            "fresh": lambda: _fresh(directory, raw, manifest, next(counter), cpu["fresh"]),
            "restarted": lambda: _restarted(directory, raw, manifest, next(counter), cpu["restarted"]),
        }, repeats)
    rolled_back = KILL_AFTER - KILL_AFTER // 20 * 20
    print(f"elastic ({repeats} rounds): {statistics.median(lost):.1f} s from the kill to the first step on 2 workers "
          f"(min {min(lost):.1f}, max {max(lost):.1f}), {rolled_back} steps trained again; steps/s after shrinking "
          f"{statistics.median(samples['elastic']):.1f} against {statistics.median(samples['fresh']):.1f} fresh and "
          f"{statistics.median(samples['restarted']):.1f} for a plain run after a restart "
          f"(steps {WINDOW[0]}-{WINDOW[1]}); "
          f"its first checkpoint after the resize {statistics.median(first_save):.2f} s longer than a later one; "
          f"the workers' CPU ms per step {statistics.median(cpu['elastic']):.1f} against "
          f"{statistics.median(cpu['fresh']):.1f} fresh and {statistics.median(cpu['restarted']):.1f} restarted")
    return [
        case("elastic: steps/s on 2 workers after losing 1 of 3 vs a fresh 2-worker run (steps/s)",
             samples["elastic"], samples["fresh"], TARGET, unit="steps/s",
             baseline_name=f"a plain 2-worker run with the same global batch (74), steps {WINDOW[0]}-{WINDOW[1]}",
             bound="the elastic input (every worker reads and shuffles every record: about 0.1 ms more CPU a "
                   "batch than the plain one) and the load of the shared machine; each process's first "
                   "checkpoint is outside the window (row below)"),
        case("elastic: steps/s on 2 workers after losing 1 of 3 vs a plain 2-worker run after a restart (steps/s)",
             samples["elastic"], samples["restarted"], TARGET, unit="steps/s",
             baseline_name="a plain 2-worker run (global batch 74) restarted from its step-40 checkpoint after "
                           f"losing worker 1, steps {WINDOW[0]}-{WINDOW[1]}",
             bound="the elastic input (every worker reads and shuffles every record, one global order)"),
        case("elastic: the 2 workers' CPU ms per step after losing 1 of 3 vs a fresh 2-worker run (ms)",
             cpu["elastic"], cpu["fresh"], TARGET, higher_is_better=False, unit="ms",
             baseline_name=f"a plain 2-worker run with the same global batch (74), steps {WINDOW[0]}-{WINDOW[1]}",
             bound="the same work per step but the elastic input's; CPU seconds, unlike steps/s, do not move much "
                   "with the shared machine's load"),
        report(f"elastic: seconds from a lost worker to the first step on the survivors ({rolled_back} steps "
               "trained again)", lost, unit="s",
               bound="detection (the exit), train.elastic.wait_s (0.5 s here), the restart backoff, the forked "
                     "workers' start, the checkpoint's restore and the input's first batches"),
        report(f"elastic: the first checkpoint after the resize (step {FIRST_SAVE}), seconds beyond a later one",
               first_save, unit="s",
               bound="a process's first checkpoint save (the saver built, about 0.2 s of the chief's CPU against "
                     "0.03-0.06 s later), paid once per resize as by any restarted or fresh process"),
    ]
