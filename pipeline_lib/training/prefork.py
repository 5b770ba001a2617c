"""What a process that forks training workers does once, before it forks: `prepare()`.

A process's first `train()` has AutoGraph rewrite the step and evaluation functions (Python AST work, a
large share of a small run's CPU) and imports TensorBoard's summary ops on its first `tf.summary` write. A long-lived
process pays once; a worker process paid every time. The fork server (`launch.forkserver`) calls `prepare()`
after its imports: each worker inherits the converted code, found in AutoGraph's cache (keyed by code object and
conversion options) by its first trace, and the imported modules. Both are pure Python: no TensorFlow context is
created and no thread started, so the server stays safe to fork.

`CONVERTED` names each function by its code's qualified name in its module and the options its first trace
converts it with: a `tf.function`'s own body with those of a user's request, a function it calls with those of a
call inside converted code. A test trains in a forked child and checks that nothing is left to convert; a
function the loop stops using only costs the server its conversion, a new one its worker's.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator

from tensorflow.python.autograph.core import converter
from tensorflow.python.autograph.impl import api

# A tf.function's body, converted as `tf.function` asks (user_requested, its `experimental_autograph_options`
# None: no optional feature), and what it calls from converted code.
_TRACED = converter.ConversionOptions(recursive=True, user_requested=True, optional_features=None)
_CALLED = _TRACED.call_options()

# tf.summary.scalar's lazy import (TensorBoard's, which brings boto3 with it).
_SUMMARY_OPS = "tensorboard.summary.v2"

CONVERTED: tuple[tuple[str, str, converter.ConversionOptions], ...] = (
    ("pipeline_lib.training.loop", "_run_synchronous.<locals>.run_steps", _TRACED),
    ("pipeline_lib.training.evaluator", "Evaluator.__init__.<locals>.batch_sums", _TRACED),
    ("pipeline_lib.training.step", "create_train_step.<locals>.train_step", _CALLED),
    ("pipeline_lib.training.step", "create_train_step.<locals>.next_batch", _CALLED),
    ("pipeline_lib.training.step", "create_train_step.<locals>.replica_step", _CALLED),
    ("pipeline_lib.training.step", "create_train_step.<locals>.loss_and_gradients", _CALLED),
    ("pipeline_lib.training.step", "create_loss_fn.<locals>.per_example", _CALLED),
)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _code_objects(constant)


def find_code(module_name: str, qualname: str) -> types.CodeType:
    """The code object of `qualname` (a nested function's `outer.<locals>.inner` too) defined in a module.

    Raises:
        LookupError: when the module defines no function of that name (the table above went stale).
    """
    module = importlib.import_module(module_name)
    top = qualname.split(".", 1)[0]
    outer = getattr(module, top, None)
    roots = [f.__code__ for f in vars(outer).values() if isinstance(f, types.FunctionType)] \
        if isinstance(outer, type) else [getattr(outer, "__code__", None)]
    for root in filter(None, roots):
        for code in _code_objects(root):
            if code.co_qualname == qualname:
                return code
    raise LookupError(f"{module_name} defines no function {qualname!r}, listed in {__name__}.CONVERTED; "
                      "update the table to the functions the training loop traces")


def _stand_in(module_name: str, code: types.CodeType) -> types.FunctionType:
    # A function of that code with the module's globals and a cell per free variable: AutoGraph reads the source
    # by the code's file and line and names its temporaries away from the names in scope, which the cells give
    # it (their values do not reach the converted code, which the real closure instantiates).
    cells = tuple(types.CellType(None) for _ in code.co_freevars)
    return types.FunctionType(code, vars(importlib.import_module(module_name)), code.co_name, None, cells)


def prepare() -> None:
    """Convert every function of `CONVERTED` into AutoGraph's cache (one already there is a cache hit) and import
    what `tf.summary` imports on first use. Creates no TensorFlow context and no thread."""
    for module_name, qualname, options in CONVERTED:
        function = _stand_in(module_name, find_code(module_name, qualname))
        # What `converted_call` does before it calls: no public API converts into this cache without calling
        # (`tf.autograph.to_graph` converts with other options, so under another key).
        api._convert_actual(function, converter.ProgramContext(options=options))
    importlib.import_module(_SUMMARY_OPS)
