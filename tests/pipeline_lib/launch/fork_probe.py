"""A child for tests/pipeline_lib/launch/test_forkserver.py: tells what it was given, then exits as told."""

import json
import os
import sys
import time


def main() -> int:
    print(json.dumps({"cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "tf_config": os.environ.get("TF_CONFIG"),
                      "argv": sys.argv, "own_session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
                      "tensorflow_imported": "tensorflow" in sys.modules}), flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    what = sys.argv[-1]
    if what == "sleep":
        time.sleep(120)
    if what == "raise":
        raise ValueError("the probe was told to fail")
    return int(what)
