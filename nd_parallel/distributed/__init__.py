"""The parallel dimensions and the one orchestrator that applies them (parallelize.py).

mesh.py builds the named DeviceMesh; each dimension has its module (tensor_parallel, fsdp, context_parallel/,
pipeline/) plus what every layout shares: activation checkpointing, precision, the global-token loss, the global
gradient norm, dataloader sharding and evaluation gathers.
"""
