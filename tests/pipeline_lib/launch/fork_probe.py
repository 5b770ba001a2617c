"""A child for tests/pipeline_lib/launch/test_forkserver.py: tells what it was given, then exits as told (or trains
a few steps and tells what AutoGraph converted on the way)."""

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
    if what == "train":
        print(json.dumps(_train()), flush=True)
        return 0
    if what == "sleep":
        time.sleep(120)
    if what == "raise":
        raise ValueError("the probe was told to fail")
    return int(what)


def _train() -> dict:
    """What this child inherited from the server (an eager context? the prepared conversions?), then a short
    training with its evaluation, recording each function AutoGraph had to convert rather than find cached."""
    from tensorflow.python.autograph.impl import api
    from tensorflow.python.autograph.pyct import transpiler
    from tensorflow.python.eager import context

    from pipeline_lib.training import loop, prefork

    inherited = {"eager_context": context._context is not None,
                 "cached": [qualname for module, qualname, options in prefork.CONVERTED
                            if api._TRANSPILER._cache.has(prefork.find_code(module, qualname), options)]}
    # Imported after the look above: importing it makes an eager context.
    from tests.pipeline_lib.launch_support import (
        make_config,
        plan_for,
        write_dataset_on_disk,
    )

    converted = []
    transform = transpiler.PyToPy.transform_function

    def recording(self, fn, user_context):
        if not self._cache.has(fn, self.get_caching_key(user_context)):
            converted.append(fn.__code__.co_qualname)
        return transform(self, fn, user_context)

    transpiler.PyToPy.transform_function = recording
    manifest = write_dataset_on_disk(os.path.join(os.getcwd(), "data"))
    config = make_config(os.getcwd(), steps=4, checkpoint_every_steps=4)
    result = loop.train(config, manifest, plan_for(manifest, config, steps=4), os.path.join(os.getcwd(), "run"))
    return {**inherited, "converted": converted, "final_step": result.final_step,
            "evaluated": bool(result.checkpoints and result.checkpoints[-1].metrics)}
