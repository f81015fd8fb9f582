"""The simulator: the SimPy replay loop, cost models and model/hardware presets.

Imports the core (``sched_lab.core``) only; never the engine (``backend``).
"""
