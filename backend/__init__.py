"""Real engine: Llama-family models with a paged KV cache, run one scheduler step at a time.
Not imported by the simulator path. Entry point: :class:`sched_lab.backend.runner.ModelRunner`."""
