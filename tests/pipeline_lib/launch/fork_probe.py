"""A child for tests/pipeline_lib/launch/test_forkserver.py: tells what it was given, then exits as told."""

import json
import os
import sys
import time

_WARMED_IN: int | None = None  # the pid whose warm_up() ran at idle priority: a fork server's spare, before its task


def warm_up(args: list[str], background) -> None:
    global _WARMED_IN
    import tensorflow as tf

    background()  # idle priority, as the worker's warm-up
    float(tf.reduce_sum(tf.ones([2, 2])))  # starts TensorFlow's runtime (its thread pools), as the worker's warm-up
    _WARMED_IN = os.getpid() if os.sched_getscheduler(0) == os.SCHED_IDLE else -1


def main() -> int:
    print(json.dumps({"cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "tf_config": os.environ.get("TF_CONFIG"),
                      "argv": sys.argv, "own_session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
                      "tensorflow_imported": "tensorflow" in sys.modules, "warm": _WARMED_IN == os.getpid(),
                      "normal_priority": all(os.sched_getscheduler(int(tid)) == os.SCHED_OTHER
                                             for tid in os.listdir("/proc/self/task"))}),
          flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    what = sys.argv[-1]
    if what == "sleep":
        time.sleep(120)
    if what == "raise":
        raise ValueError("the probe was told to fail")
    return int(what)
