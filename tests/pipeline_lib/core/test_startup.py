"""core.startup: imports run with the cyclic collector off, and what they made ends up out of its reach."""

from __future__ import annotations

import gc

import pytest

from pipeline_lib.core import startup


@pytest.fixture
def collector_restored():
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def test_a_block_runs_without_the_collector_and_leaves_what_it_made_frozen(collector_restored):
    gc.enable()
    gc.unfreeze()
    with startup.imports():
        assert not gc.isenabled()
        made = [[index] for index in range(1000)]  # containers the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    collected = {id(item) for item in gc.get_objects()}  # the generations a collection walks, not the frozen
    assert not any(id(item) in collected for item in made)


def test_a_block_inside_another_leaves_the_collector_off_until_the_outer_block_ends(collector_restored):
    gc.enable()
    with startup.imports():
        with startup.imports():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_comes_back_when_the_block_raises(collector_restored):
    gc.enable()
    with pytest.raises(ValueError), startup.imports():
        raise ValueError("an import failed")
    assert gc.isenabled()
