"""Rank program of test_ep_checkpoint.py: checkpoint_worker's save phase, then its load phase, in one launch.

Usage (under torchrun): ep_checkpoint_worker.py OUT_DIR SPEC_JSON (checkpoint_worker's spec).
"""

import json
import sys

from checkpoint_worker import load_phase, save_phase

if __name__ == "__main__":
    spec = json.load(open(sys.argv[2]))
    save_phase(spec)
    load_phase(spec)
