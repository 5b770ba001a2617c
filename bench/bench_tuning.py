"""Tuning: trials per hour of tfdag's study runner against a bare Optuna loop calling tfdag's `train()` in-process,
and the speed-up of two trials at a time on the machine it runs on.

What is timed, and why it is honest:

* Both sides run the same study: the same space (learning rate, hidden units, dropout), the same TPE sampler and
  seed, the same number of trials, each trial the same training budget on the same converted digits. Pruning is off
  on both sides, so both train every step of every trial.
* The baseline is what a user who skips tfdag's runner writes: `optuna.create_study` in memory and an objective that
  calls `pipeline_lib.training.loop.train` in the same process and returns the best eval metric of the trial's
  checkpoints. It pays no process start, but carries memory from trial to trial (the complaint of optuna#3050) and
  loses everything when it crashes.
* tfdag runs `tuning.runner.run_study` with the local launcher: each trial a supervised worker process, forked
  from the launcher's fork server (`launch.forkserver`), the study in a journal file that survives a crash. The
  server's one TensorFlow import is made before the timed rounds, as the baseline's is (the bench process imported
  TensorFlow before either side runs); `tfdag tune` overlaps it with conversion (`Launcher.warm_up`).
* The sides alternate (baseline, tfdag, tfdag with `parallel: 2`) for `repeats` rounds; medians and min-max of
  trials per hour are recorded.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from bench import case, interleaved

TARGET = 0.7
SPACE = {
    "train.base_learning_rate": {"loguniform": [1.0e-3, 3.0e-2]},
    "model.params.hidden_units": {"choice": [[64], [128, 64]]},
    "model.params.dropout": {"uniform": [0.0, 0.3]},
}


def _config(directory: str, raw: str, trials: int, steps: int, parallel: int, study: str):
    from pipeline_lib.config import parse_config

    return parse_config({
        "name": "bench-tune", "data": {"source": raw, "label": "target", "target_shard_mb": 0.1},
        "output_root": os.path.join(directory, "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [64], "dropout": 0.1}},
        "train": {"per_replica_batch_size": 32, "base_learning_rate": 0.002, "steps": steps,
                  "checkpoint_every_steps": max(steps // 2, 1), "log_every_steps": steps, "seed": 7,
                  "early_stopping": {"enabled": False}},
        "evaluation": {"metrics": ["loss", "accuracy"]},
        "tracking": {"enabled": False},
        "tune": {"trials": trials, "parallel": parallel, "seed": 0, "pruner": "none", "study": study,
                 "space": SPACE},
    })


def _tfdag(directory: str, raw: str, manifest, trials: int, steps: int, parallel: int, round_: int) -> float:
    from pipeline_lib.launch import launchers
    from pipeline_lib.planning import sharding
    from pipeline_lib.training import strategy
    from pipeline_lib.tuning.runner import run_study

    config = _config(directory, raw, trials, steps, parallel, f"tfdag-p{parallel}-{round_}")

    def launch(trial_config, run_dir, number):
        plan = sharding.plan_for_train(manifest, trial_config.train, strategy.replicas_per_worker(trial_config.train))
        return launchers.launch_training(trial_config, manifest, plan, run_dir,
                                         options=launchers.LaunchOptions(log_fn=lambda line: None))

    start = time.perf_counter()
    result = run_study(config, manifest, launch=launch)
    elapsed = time.perf_counter() - start
    assert result.counts["complete"] == trials, result.counts
    return trials * 3600.0 / elapsed


def _bare_optuna(directory: str, raw: str, manifest, trials: int, steps: int, round_: int) -> float:
    import optuna

    from pipeline_lib.planning import sharding
    from pipeline_lib.training import loop, strategy
    from pipeline_lib.tuning import space
    from pipeline_lib.tuning.study import tuned_metric

    config = _config(directory, raw, trials, steps, 1, f"bare-{round_}")
    metric, _ = tuned_metric(config)

    def objective(trial: optuna.Trial) -> float:
        values = space.suggest(trial, config.tune.space)
        trial_config = space.apply(config, values)
        plan = sharding.plan_for_train(manifest, trial_config.train, strategy.replicas_per_worker(trial_config.train))
        result = loop.train(trial_config, manifest, plan, os.path.join(directory, f"bare-{round_}-{trial.number}"))
        return max(r.metrics[metric] for r in result.checkpoints if metric in r.metrics)

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    start = time.perf_counter()
    study.optimize(objective, n_trials=trials)
    return trials * 3600.0 / (time.perf_counter() - start)


def run(trials: int = 4, steps: int = 2000, quick: bool = False) -> list[dict]:
    from pipeline_lib.data import demo
    from pipeline_lib.data.convert import convert
    from pipeline_lib.launch import processes
    from pipeline_lib.tuning.study import quiet_optuna

    quiet_optuna()
    trials, steps = (4, 200) if quick else (trials, steps)
    repeats = 1 if quick else 2
    with tempfile.TemporaryDirectory() as directory:
        raw = os.path.join(directory, "raw", "digits.csv")
        demo.write_digits_csv(raw)
        config = _config(directory, raw, trials, steps, 1, "convert")
        manifest = convert(config.data, config.output_root, config.storage_options)
        processes.warm_fork_server({})  # waits
        counter = iter(range(10_000))
        samples = interleaved({
            "bare": lambda: _bare_optuna(directory, raw, manifest, trials, steps, next(counter)),
            "tfdag": lambda: _tfdag(directory, raw, manifest, trials, steps, 1, next(counter)),
            "tfdag2": lambda: _tfdag(directory, raw, manifest, trials, steps, 2, next(counter)),
        }, repeats)
    print(f"tuning ({trials} trials of {steps} steps on digits, TPE, no pruning; medians of {repeats} rounds):")
    for name, values in samples.items():
        print(f"  {name:<7} {statistics.median(values):>8.1f} trials/h (min {min(values):.1f}, "
              f"max {max(values):.1f})")
    shape = f"{trials} trials x {steps} steps"
    return [
        case(f"tfdag tune runner vs a bare Optuna loop over train(), {shape} (trials/h)", samples["tfdag"],
             samples["bare"], TARGET, unit="trials/h",
             baseline_name="optuna.create_study + objective calling pipeline_lib.training.loop.train in-process",
             bound="each tfdag trial forks a supervised worker process and restores its study from the journal; "
                   "the rest is the same training"),
        case(f"tfdag tune, parallel 2 vs parallel 1, {shape} (trials/h)", samples["tfdag2"], samples["tfdag"], 1.0,
             unit="trials/h", baseline_name="the same runner, one trial at a time",
             bound="two trials share this machine's 2 cores; the speed-up is what one trial leaves idle "
                   "(process start, evaluation, checkpoint writes)"),
    ]
