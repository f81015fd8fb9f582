"""The core: requests, the KV block manager, the step plan, the scheduler and its shared moves.

Pure Python with no I/O and no imports from the rest of the project: policies build on it,
and both executors (the simulator in ``lab.sim``, the engine in ``backend``) read its plans.
"""
