"""What a pipeline schedule really did: per-rank, per-micro-batch F / B / W intervals of real steps.

Four modules, split by what each needs to run:

    events    the ``Event`` record the other three share
    record    wraps the stages of a live schedule and gathers their intervals over the pp group (collectives)
    analysis  pure: bubble fractions, the analytical bubble of each schedule, a dependency replay
    render    pure output: a Chrome trace (open in https://ui.perfetto.dev) and the textbook pipeline picture

Only ``record`` needs a process group; the others work on events from anywhere (a saved trace included),
which is how they are tested and how the benchmarks reuse them.
"""
