"""The outer loop's actions (Orbit's `train_actions`/`eval_actions`): `base.LoopAction`, the points the controller
runs them at, and one action a module: `preemption` (save and leave on a stop request), `early_stopping` (the
patience rule), `pruning` (a tuning trial's pruner), `profiling` (a trace of `observability.profile_steps`),
`tensorboard` (a remote run's TensorBoard upload) and `coordinator` (the parameter-server join before a save).
"""
