"""What each ``backend:`` reads of an experiment YAML and which features it has: one row per
backend name, so that no check compares the backend's name. A key in ``reads`` is checked
strictly; one outside it is kept as written (paths made absolute)."""

from __future__ import annotations

from dataclasses import dataclass

# The step size the KV sizing reserves activation memory for when
# scheduler.max_num_batched_tokens is null: vLLM's chunked-prefill budget in the
# simulator; on the engine, the tokens of its warm-up forward (which measures the
# activation peak) and the cut of its token-count CUDA graphs (backend/runner.py).
SIM_PROFILE_TOKENS, ENGINE_PROFILE_TOKENS = 2048, 8192


@dataclass(frozen=True)
class Backend:
    """One backend's row.

    Args:
        reads: the sections and dotted keys it reads (``speculative.model``, ...).
        profile_tokens: the step size KV sizing reserves activations for when
            ``scheduler.max_num_batched_tokens`` is null.
        simulated_steps: step times (and acceptance) come from a model the YAML sets;
            false: measured, so simulator-only keys are refused or warned about.
        async_speculative: it runs speculative decoding under async scheduling.
    """

    reads: frozenset[str]
    profile_tokens: int
    simulated_steps: bool
    async_speculative: bool


BACKENDS: dict[str, Backend] = {
    "sim": Backend(
        reads=frozenset(
            {"model", "hardware", "cost_model", "cluster", "speculative.acceptance_from"}
        ),
        profile_tokens=SIM_PROFILE_TOKENS,
        simulated_steps=True,
        async_speculative=True,
    ),
    "engine": Backend(
        reads=frozenset({"engine", "speculative.model"}),
        profile_tokens=ENGINE_PROFILE_TOKENS,
        simulated_steps=False,
        async_speculative=False,
    ),
}
