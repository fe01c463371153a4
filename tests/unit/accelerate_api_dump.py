"""Print, as JSON, every public attribute of Accelerate's ParallelismConfig for the layouts in LAYOUTS.

Run by tests/unit/test_accelerate_api.py with this interpreter and with another one (the Axolotl venv's, which has
accelerate 1.13), so the attribute parity is checked against both versions. Methods are recorded as "<method>".
"""

import dataclasses
import json
import sys

LAYOUTS = [{}, {"dp_shard_size": 2}, {"dp_replicate_size": 2, "dp_shard_size": 2}, {"tp_size": 2}, {"cp_size": 2},
           {"dp_shard_size": 2, "tp_size": 2}, {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2},
           {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2}]


def describe(config) -> dict:
    out = {}
    for name in sorted(n for n in dir(type(config)) if not n.startswith("_")):
        value = getattr(config, name)
        if callable(value) and not dataclasses.is_dataclass(value):
            out[name] = "<method>"
        elif dataclasses.is_dataclass(value):
            out[name] = {"type": type(value).__name__, **dataclasses.asdict(value)}
        else:
            out[name] = value
    return out


def main() -> None:
    import accelerate
    from accelerate.parallelism_config import ParallelismConfig

    fields = [f.name for f in dataclasses.fields(ParallelismConfig)]
    print(json.dumps({"version": accelerate.__version__, "fields": fields,
                      "layouts": [describe(ParallelismConfig(**layout)) for layout in LAYOUTS]}, default=repr))


if __name__ == "__main__" and sys.argv[1:] == []:
    main()
