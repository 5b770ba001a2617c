"""Hyperparameter tuning over Optuna: `space` (sampled values into a config), `study` (the study, its storage,
sampler and pruner), `pruning` (a trial's chief reporting its evaluations and stopping when pruned) and `runner`
(`run_study`: trials `tune.parallel` at a time, each an ordinary supervised training).

Only a search imports this package: the worker loads `pruning` in a trial's chief alone, so a run without `tune`
never imports Optuna.
"""
