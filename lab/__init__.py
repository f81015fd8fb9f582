"""sched-lab: an LLM-serving scheduler lab (simulator and real engine, one policy code base)."""

__version__ = "0.1.0"
