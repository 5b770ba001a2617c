"""`tfdag convert` and `tfdag plan`: the stage commands start from one path, config -> manifest -> plan."""

from __future__ import annotations

import json

import yaml

from flows import cli
from pipeline_lib.data import demo as demo_data


def _command(*argv: str) -> int:
    args = cli.build_parser().parse_args(list(argv))
    return args.fn(args)


def test_convert_then_plan_reuse_one_conversion_and_plan_for_the_workers_asked(tmp_path, capsys):
    raw = tmp_path / "raw" / "digits.csv"
    demo_data.write_digits_csv(str(raw))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({
        "name": "cli-stages",
        "data": {"source": str(raw), "label": "target", "target_shard_mb": 0.1},
        "output_root": str(tmp_path / "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [8]}},
        "train": {"strategy": "default", "per_replica_batch_size": 16, "epochs": 1},
    }))
    assert _command("convert", str(path)) == 0
    converted = json.loads(capsys.readouterr().out)
    assert converted["train_records"] + converted["eval_records"] == 1797 and converted["shards"] >= 2
    assert _command("plan", str(path), "--workers", "2") == 0
    plan = capsys.readouterr().out
    # Planned for the 2 workers asked instead of train.workers, on the conversion `convert` made (reused, not redone).
    assert "| workers | 2 |" in plan and "| global batch | 32 |" in plan, plan
    assert [d.name for d in (tmp_path / "out" / "data").iterdir()] == [converted["fingerprint"]]
