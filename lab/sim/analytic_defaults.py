"""The analytic roofline's default efficiencies, fitted where the repo has a profile.

    python -m sched_lab.sim.analytic_defaults      # re-fit the shipped profiles, print the table

``cost_model.flops_efficiency``, ``bandwidth_efficiency`` and ``step_overhead_s``, when the
YAML leaves them out, come from :func:`defaults` for ``(model, hardware)``:

1. the model's own shipped profile on that hardware: its fit
   (:func:`sched_lab.sim.calibrated.fit_analytic`);
2. another model on hardware with profiles: the joint fit over all of that hardware's
   profile rows (:func:`joint_fit`);
3. hardware without a profile: the datasheet guesses :data:`GUESS`.

:data:`FITTED` stores the fits; tests/test_analytic_defaults.py checks them against a refit.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

ROOT = Path(str(files("sched_lab.profiles"))).parent  # holds profiles/ (see ROOT / rel)
REFIT = "python -m sched_lab.sim.analytic_defaults"


@dataclass(frozen=True)
class Efficiencies:
    """Default analytic-model values and their source.

    Attributes:
        flops_efficiency, bandwidth_efficiency, step_overhead_s: the cost_model keys.
        source: "profile" (fitted to ``profiles``) or "guess" (datasheet assumptions).
        profiles: the profile files fitted, relative to the repo root (empty for a guess).
        median_relative_error: on those profiles' rows (None for a guess).
    """

    flops_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    source: str
    profiles: tuple[str, ...] = ()
    median_relative_error: float | None = None

    @property
    def values(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in KEYS}


KEYS = ("flops_efficiency", "bandwidth_efficiency", "step_overhead_s")
GUESS = Efficiencies(0.7, 0.85, 0.002, "guess")
QWEN, LLAMA = "profiles/h200_qwen3-0.6b.csv", "profiles/h200_llama-3.1-8b.csv"
# (hardware, model) -> fitted values; model None: the joint fit to the hardware's profiles.
# Reproduce with REFIT (it prints these rows); checked by tests/test_analytic_defaults.py.
FITTED: dict[tuple[str, str | None], Efficiencies] = {
    ("h200-sxm", "qwen3-0.6b"): Efficiencies(0.43, 0.794, 0.0014, "profile", (QWEN,), 0.0777),
    ("h200-sxm", "llama-3.1-8b"): Efficiencies(0.584, 0.735, 0.0008, "profile", (LLAMA,), 0.0612),
    ("h200-sxm", None): Efficiencies(0.501, 0.794, 0.00135, "profile", (QWEN, LLAMA), 0.0885),
}


def defaults(model: str, hardware: str) -> Efficiencies:
    """The analytic defaults of ``model`` on ``hardware`` (preset names)."""
    return FITTED.get((hardware, model)) or FITTED.get((hardware, None)) or GUESS


def describe(e: Efficiencies) -> str:
    """A phrase for report.md: where the values come from and their known error."""
    if e.source == "guess":
        return "datasheet guesses (no profile for this hardware): their error is unknown"
    joint = " (joint fit: no profile of this model)" if len(e.profiles) > 1 else ""
    return (
        f"fitted to {', '.join(f'`{p}`' for p in e.profiles)}{joint}; median relative step-"
        f"time error {e.median_relative_error:.1%} on the profile rows it prices (`{REFIT}`)"
    )


def refit() -> dict[tuple[str, str | None], Efficiencies]:
    """:data:`FITTED` recomputed from the profile files it names (errors to 4 digits)."""
    from sched_lab.sim.calibrated import fit_analytic, profile_shape, read_profile

    out: dict[tuple[str, str | None], Efficiencies] = {}
    by_hw: dict[str, list[tuple[str, str]]] = {}
    for rel in sorted({p for e in FITTED.values() for p in e.profiles}):
        model, hw = profile_shape(ROOT / rel)
        fit = fit_analytic(read_profile(ROOT / rel), model, hw)
        out[(hw, model)] = _from_fit(fit, (rel,))
        by_hw.setdefault(hw, []).append((rel, model))
    for hw, pairs in by_hw.items():
        if len(pairs) > 1:
            rels = tuple(r for r, _ in sorted(pairs, key=lambda x: x[0] != QWEN))
            out[(hw, None)] = _from_fit(joint_fit(pairs, hw), rels)
    return out


def _from_fit(fit: dict, profiles: tuple[str, ...]) -> Efficiencies:
    return Efficiencies(
        *(fit[k] for k in KEYS), "profile", profiles, round(fit["median_relative_error"], 4)
    )


def joint_fit(pairs: list[tuple[str, str]], hardware: str) -> dict[str, float]:
    """:func:`sched_lab.sim.calibrated.fit_analytic` over the rows of several profiles ``(path relative
    to the repo, model preset)``, each row priced with its model."""
    import numpy as np

    from sched_lab.sim.calibrated import analytic_terms, fit_roofline, read_profile

    terms = [analytic_terms(read_profile(ROOT / rel), model, hardware) for rel, model in pairs]
    return fit_roofline(*(np.concatenate(column) for column in zip(*terms, strict=True)))


def main() -> int:
    """Print :func:`refit`'s table in :data:`FITTED`'s form."""
    for key, e in refit().items():
        print(f"{key}: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
