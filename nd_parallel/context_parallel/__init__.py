"""Context parallelism: the sequence of every sample is split over the cp ranks.

sharding.py cuts a batch into each rank's (load-balanced) share of the sequence; attention.py holds the ring
and Ulysses attention kernels; hf.py registers them in transformers' AttentionInterface and wires the
sharding into a prepared model.
"""
