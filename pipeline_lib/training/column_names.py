"""What a table's column is called inside the model: any name a table can hold becomes a safe one, once.

A column's name may be anything (spaces, punctuation, non-ASCII, a Python keyword, `numeric`). Inside the model
and its export it must be more: a Keras layer name and TensorFlow scope name (`[A-Za-z0-9_.-]`), a SavedModel
signature input and a Python parameter name. `input_names` makes one such name per column, used as its key in
the model's inputs dict (Keras wants a dict's keys to be its inputs' names), the name of the layers built on it
and its input in the exported signature. A plain name (`age`, `city_name`) is its own.
"""

from __future__ import annotations

import keyword
import re

from pipeline_lib.data.manifest import Schema

NUMERIC_KEY = "numeric"  # the inputs dict's key (and Keras input) of every number feature, concatenated


def input_names(schema: Schema) -> dict[str, str]:
    """Each column's name as a model input, a layer name prefix and a signature input.

    TensorFlow names the signature function's parameters after its inputs, and rewrites (with
    `function_type.sanitize_arg_name`) or rejects (a keyword: "'class' is not a valid parameter name"; `self`,
    the parameter of its own methods that build and call a signature) any other; a layer name must be a scope
    name. So characters outside `[A-Za-z0-9_]` become `_`, a name that does not start with a letter gets a `c` in
    front, a keyword (`class`, `None`), `self` or `numeric` (the numbers' own input) a `_` behind, and a number is
    appended where two collide; `tfdag_serving.json` maps each input back to its column.
    """
    names: dict[str, str] = {}
    for spec in schema.features:
        base = re.sub(r"[^A-Za-z0-9_]", "_", spec.name)
        base = base if re.match(r"[A-Za-z]", base) else f"c{base}"
        base = f"{base}_" if keyword.iskeyword(base) or base in ("self", NUMERIC_KEY) else base
        name, n = base, 1
        while name in names.values():
            n += 1
            name = f"{base}_{n}"
        names[spec.name] = name
    return names
