"""`nd-parallel train`: an Axolotl-style YAML (config.py with keys.py and schema.py) turned into a job (job.py) in
the parent, the data prepared (data/), then the rank program (rank.py) under torchrun with its callbacks."""
