"""`nd-parallel train` (command.py): an Axolotl-style YAML (config.py with keys.py and schema.py) turned into a typed
job (job.py) in the parent, the data prepared (data/), then the rank program (rank.py) under torchrun with its
callbacks. rank.py also runs `nd-parallel demo`'s job."""
