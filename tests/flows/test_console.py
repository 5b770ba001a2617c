"""The console of `tfdag run` is for people: no TensorFlow start-up lines, no warnings answered elsewhere, a short
log; `-v` brings TensorFlow's lines back."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("oneDNN", "cuda_platform", "cudart_stub", "Value in checkpoint could not be found", "Sharding callback",
         "is deprecated", "UserWarning", "absl::InitializeLog")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFDAG_VERBOSE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _tfdag(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = _env()
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900, check=False)


def _assert_the_json_summary(line: str) -> dict:
    """`--json`'s last line: the run summary of the example, registered and blessed."""
    summary = json.loads(line)
    assert summary["pipeline"] == "digits" and summary["mlflow_run_id"] and summary["model_version"] == "1"
    assert summary["blessed"] is True and summary["global_batch_size"] == 32 * summary["num_replicas"], summary
    return summary


@pytest.mark.slow
def test_a_default_run_of_the_example_prints_fewer_than_60_lines_and_no_noise_and_json_on_the_last_line(
        tmp_path, prefect_api):
    """Outside a terminal (a script's view): the log on stderr, the summary as JSON on stdout's last line."""
    shutil.copy(ROOT / "examples" / "digits.yaml", tmp_path / "digits.yaml")
    out = _tfdag(tmp_path, "run", "digits.yaml", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    found = {marker: [line for line in lines if marker in line][:2] for marker in NOISE}
    assert not any(found.values()), {k: v for k, v in found.items() if v}
    assert len(lines) < 60, "\n".join(lines)
    assert "blessed: true" in out.stdout
    _assert_the_json_summary(out.stdout.strip().splitlines()[-1])


def test_verbose_brings_tensorflow_start_up_lines_back(tmp_path):
    shutil.copy(ROOT / "examples" / "digits.yaml", tmp_path / "digits.yaml")
    quiet = _tfdag(tmp_path, "convert", "digits.yaml")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "oneDNN" not in quiet.stderr and "absl::InitializeLog" not in quiet.stderr
    verbose = _tfdag(tmp_path, "-v", "convert", "digits.yaml")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "oneDNN" in verbose.stderr or "cudart_stub" in verbose.stderr, verbose.stderr[:3000]


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def _tfdag_in_a_terminal(tmp_path: Path, *args: str, timeout_s: float = 900) -> tuple[int, str]:
    """`tfdag ARGS` with stdout and stderr on one pseudo-terminal of 40 x 140: (exit code, output without the
    terminal's control sequences)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = {**_env(), "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=tmp_path, env=env,
                               stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer of the terminal has exited
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
        code = process.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    return code, ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))


@pytest.mark.slow
def test_in_a_terminal_tfdag_run_shows_the_stages_the_training_bar_a_summary_table_and_json_last(tmp_path,
                                                                                               prefect_api):
    # The example as a user has it, trained 5 epochs and without the model check (not a stage of the checklist):
    # what is tested is the display; the example's own run is the test above.
    values = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    values["train"]["epochs"] = 5
    values.setdefault("evaluation", {})["validate_model"] = False
    (tmp_path / "digits.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    code, text = _tfdag_in_a_terminal(tmp_path, "run", "digits.yaml", "--json")
    assert code == 0, text[-3000:]
    # The checklist, each stage done with its duration.
    for stage in ("check_storage", "convert_to_tfrecords", "validate_cluster", "plan_shards", "train",
                  "consolidate_checkpoints", "evaluate", "gate", "track"):
        assert re.search(rf"✔ {stage} +(\d+\.\d s|\d+:\d\d)", text), f"{stage} not done in:\n{text[-5000:]}"
    # The conversion bar done, and the training bar at its total.
    assert re.search(r"convert +━+ 100% 1,797 rows [0-9.]+ MB/s", text), text[-5000:]
    [total] = {int(m) for m in re.findall(r"(\d+)/\1 steps", text)}
    assert total > 0 and re.search(rf"{total}/{total} steps .*eval_accuracy 0\.\d{{4}}", text), text[-5000:]
    # The summary table, the last thing before `--json`'s line, which ends the output: the live display leaves the
    # terminal's last line to the JSON.
    tail = text[text.rindex("tfdag run digits-"):]
    assert re.search(r"│ blessed +│ true: accuracy 0\.\d+", tail) and "│ final step " in tail, tail
    summary = _assert_the_json_summary(text.strip().splitlines()[-1])
    assert re.search(rf"│ final step +│ {summary['final_step']}\b", tail), tail
    found = {marker for marker in NOISE if marker in text}
    assert not found, found
