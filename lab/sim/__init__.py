"""The simulator: the SimPy replay loop, cost models and model/hardware presets.

Imports the core (``lab.core``) only; never the engine (``backend``).
"""
