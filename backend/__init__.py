"""Real engine: Llama-family models with a paged KV cache, run one scheduler step at a time.

Nothing here is imported by the simulator path; torch is imported only by the modules that
need it. Entry point: :class:`backend.runner.ModelRunner`.
"""
