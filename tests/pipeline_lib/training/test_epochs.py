"""Tests for pipeline_lib.training.epochs: the training input over every epoch, reshuffled by a fixed seed each."""

from __future__ import annotations

import numpy as np

from pipeline_lib.config import parse_config
from pipeline_lib.training import epochs


def _config(**train):
    values = {"per_replica_batch_size": 32, "base_learning_rate": 0.01, "checkpoint_every_steps": 20,
              "log_every_steps": 10, "lr_scaling": "none"}
    values.update(train)
    return parse_config({"data": {"source": "unused.csv", "label": "label"},
                         "model": {"params": {"hidden_units": [16]}}, "train": values})


def _epoch_batches(dataset) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(inputs["numeric"].numpy(), labels.numpy()) for inputs, labels in dataset]


def _assert_same_batches(got, expected) -> None:
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_one_pipeline_for_every_epoch_gives_the_batches_of_one_pipeline_per_epoch(tiny_manifest):
    """The training input (all epochs traced once) equals building each epoch's pipeline alone, the recipe it
    replaced: epoch e shuffled with epoch_seed(seed, e), the first epoch resumed 3 batches in."""
    import keras

    from pipeline_lib.training import input_pipeline

    config = _config(shuffle=True, shuffle_buffer=64)
    keras.utils.set_random_seed(config.train.seed)  # as train() does
    batch, per_epoch, start_epoch, skip, num_epochs = 8, 30, 1, 3, 4
    got = _epoch_batches(epochs.epochs_dataset(tiny_manifest, config.train, batch, None, None, True, per_epoch,
                                               start_epoch, skip, num_epochs))
    expected, by_epoch = [], []
    for epoch in range(start_epoch, num_epochs):
        first = skip if epoch == start_epoch else 0
        alone = input_pipeline.create_dataset(
            tiny_manifest, "train", batch, shuffle=True, seed=epochs.epoch_seed(config.train.seed, epoch),
            shuffle_buffer=64, drop_remainder=True, skip_batches=first, is_classification=True).take(per_epoch - first)
        by_epoch.append(_epoch_batches(alone))
        expected += by_epoch[-1]
    assert len(got) == (num_epochs - start_epoch) * per_epoch - skip
    _assert_same_batches(got, expected)
    assert not np.array_equal(by_epoch[1][0][1], by_epoch[2][0][1])  # each epoch is shuffled anew


def test_epoch_seed_is_the_same_for_an_int_and_a_tensor_epoch_at_any_seed():
    import tensorflow as tf

    for seed in (0, 42, -7, 10**15, 2**62):
        for epoch in (0, 1, 613):
            expected = epochs.epoch_seed(seed, epoch)
            assert 0 <= expected < 2**31 - 1
            assert int(epochs.epoch_seed(seed, tf.constant(epoch, tf.int64))) == expected


def test_training_input_builds_and_repeats_with_seed_zero(tiny_manifest):
    """A global seed of 0 (train.seed: 0) would make tf.data ask a traced seed for its truth value."""
    import keras

    config = _config(shuffle=True, shuffle_buffer=64, seed=0)
    keras.utils.set_random_seed(0)

    def build():
        return _epoch_batches(epochs.epochs_dataset(tiny_manifest, config.train, 8, None, None, True, 30, 0, 0, 3))

    first = build()
    _assert_same_batches(build(), first)
    assert len(first) == 90
    assert not np.array_equal(first[0][1], first[30][1]) and not np.array_equal(first[30][1], first[60][1])


def test_parameter_server_input_honours_train_shuffle_and_seed(tiny_manifest):
    import tensorflow as tf

    def first_labels(**train) -> np.ndarray:
        fn = epochs.create_parameter_server_dataset_fn(tiny_manifest, _config(shuffle_buffer=64, **train).train,
                                                       global_batch=16, is_classification=True)
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
        return np.concatenate([labels.numpy() for _, labels in fn(context).take(8)])

    in_file_order = np.concatenate([labels.numpy() for _, labels in epochs.input_pipeline.create_dataset(
        tiny_manifest, "train", 16).take(8)])
    np.testing.assert_array_equal(first_labels(shuffle=False), in_file_order)
    np.testing.assert_array_equal(first_labels(shuffle=True, seed=3), first_labels(shuffle=True, seed=3))
    assert not np.array_equal(first_labels(shuffle=True, seed=3), first_labels(shuffle=True, seed=4))
    assert not np.array_equal(first_labels(shuffle=True, seed=3), in_file_order)
