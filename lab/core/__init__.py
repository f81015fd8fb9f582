"""The core: requests, KV blocks, the step plan, the scheduler. Stdlib only, no I/O."""
