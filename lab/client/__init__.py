"""The client side: ``sched-lab bench`` replays an experiment's trace against any
OpenAI-compatible endpoint and writes the results folder ``sched-lab run`` writes;
``sched-lab compare`` holds two results folders side by side (docs/bench.md).

A top room, like the CLI: it may import every room below it. aiohttp is imported only by
:mod:`sched_lab.client.http` (the ``serve`` extra).
"""
