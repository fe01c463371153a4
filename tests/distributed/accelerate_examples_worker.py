"""Rank program (or one process) for test_accelerate_examples.py: runs our copies of Accelerate's ND-parallel
example scripts (examples/accelerate_nd_parallel/) one after another in this process, unchanged.

Usage: accelerate_examples_worker.py OUT_DIR SPEC_JSON     (under torchrun / accelerate launch, or plain python)
SPEC_JSON: {"runs": [[name, script, [argv...], {env: value | null}]]}. Each run gets its environment (null removes a
variable; the PARALLELISM_CONFIG_* layout of the Trainer script comes this way, as from a launch config file), a
fresh AcceleratorState, and its own output directory; the script runs as __main__. Without a launcher a one-rank
gloo group stands in, so the loop's dist.all_reduce runs in the one-process reference too. The loop ends with
``accelerator.end_training()``, which destroys the world group; the next script in this process would then
initialise it again against the launcher's store, whose keys the first group used (it hangs, now and then). So
destroying is put off to the end of the process: a harness matter, the scripts are untouched.
"""

import json
import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "accelerate_nd_parallel"


def run(name: str, script: str, argv: list[str], env: dict, out: Path) -> None:
    from accelerate.state import AcceleratorState

    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
    AcceleratorState._reset_state(True)
    sys.argv = [str(EXAMPLES / script), *[a.replace("{out}", str(out / name)) for a in argv]]
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    if dist.is_initialized():
        dist.barrier()


def main(out_dir: str, spec_path: str) -> None:
    from accelerate.state import AcceleratorState, PartialState

    spec = json.loads(Path(spec_path).read_text())
    for cls in (PartialState, AcceleratorState):  # see the module docstring
        cls.destroy_process_group = lambda self, group=None: None
    if "RANK" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sys.path.insert(0, str(EXAMPLES))  # the scripts import their utils.py
    for name, script, argv, env in spec["runs"]:
        run(name, script, argv, env, Path(out_dir))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
