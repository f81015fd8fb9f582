"""The ``policies:`` list (one entry per run configuration) and ``speculative:`` blocks. An
entry is a registered policy's name, or a mapping of ``name``, ``label``, its own limits,
``preemption_victim``, ``async_scheduling``, ``enable_prefix_caching``, ``speculative`` and
the policy's ``options``."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sched_lab import policies
from sched_lab.config import paths
from sched_lab.config.sections import (
    ASYNC_KEY,
    LIMIT_KEYS,
    MAX_LIMIT,
    VICTIM_KEY,
    KVCacheConfig,
    SchedulerConfig,
)
from sched_lab.config.trace import LABEL
from sched_lab.config.walker import (
    Context,
    check_bool,
    check_choice,
    check_int,
    check_mapping,
    existing,
    fail,
)
from sched_lab.core.errors import ConfigError, short_repr
from sched_lab.core.scheduler import VICTIM_RULES
from sched_lab.core.spec import SpeculativeConfig
from sched_lab.policies import get_policy
from sched_lab.sim.models import MODELS

DEFAULT_POLICIES = ("fcfs", "swap", "chunked_prefill")


def how_to_add_a_policy() -> str:
    """The unknown-policy error's hint. The lab loads policies only from the modules of its
    own policies/ folder and from classes registered in the running process
    (:func:`sched_lab.policies.register_policy`); in a checkout (an editable install) the
    folder is the user's to add a file to, in an installed copy (a wheel) it is not."""
    folder = Path(policies.__file__).parent
    if (paths.DATA_ROOT / "pyproject.toml").exists():  # a checkout, or an editable install
        return f"a new policy is one file in {folder}/ (docs/policies.md)"
    return (
        "this sched_lab is an installed copy, which loads policies only from its own "
        "package: register yours from your script with sched_lab.policies.register_policy "
        "and run it through the Python API (docs/python_api.md), or add a file to "
        "policies/ of a checkout installed with pip install -e . (docs/policies.md)"
    )


@dataclass(frozen=True)
class PolicyConfig:
    """One entry of ``policies:``; its limits and ``enable_prefix_caching`` are None where
    the ``scheduler`` / ``kv_cache`` sections' apply."""

    name: str
    label: str
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    enable_prefix_caching: bool | None = None
    # Speculative decoding for this policy's runs (lab/core/spec.py): the entry's own
    # ``speculative:`` (``own_speculative``) or else the top-level one; None = off.
    speculative: SpeculativeConfig | None = None
    own_speculative: bool = False

    def prefix_caching(self, kv: KVCacheConfig) -> bool:
        """Whether this policy's runs cache prefixes (its own key, else ``kv_cache``'s)."""
        own = self.enable_prefix_caching
        return own if own is not None else kv.enable_prefix_caching

    def limit(self, key: str, scheduler: SchedulerConfig) -> int | None:
        """This policy's value of a limit in :data:`LIMIT_KEYS`, else the scheduler's."""
        own = getattr(self, key)
        return own if own is not None else getattr(scheduler, key)

    def to_dict(self) -> dict[str, Any]:
        limits = {k: getattr(self, k) for k in LIMIT_KEYS if getattr(self, k) is not None}
        own = (
            {}
            if self.enable_prefix_caching is None
            else {"enable_prefix_caching": self.enable_prefix_caching}
        )
        if self.own_speculative:
            own["speculative"] = None if self.speculative is None else self.speculative.to_dict()
        return {
            "label": self.label,
            "name": self.name,
            **limits,
            **own,
            **copy.deepcopy(dict(self.options)),
        }


def parse_policies(
    ctx: Context,
    pols: Any,
    tenants: frozenset[str] = frozenset(),
    spec: SpeculativeConfig | None = None,
    spec_keys: tuple[str, ...] = (),
) -> tuple[PolicyConfig, ...]:
    """The policy entries. ``spec``: the top-level ``speculative:`` block (``spec_keys``: its
    written keys), replaced whole by an entry's own; ``tenants``: those the classes name."""
    where = ctx.where
    if policies.BROKEN:  # a policy file that cannot be imported: say which, run nothing
        path, why = next(iter(policies.BROKEN.items()))
        raise ConfigError(f"{path}: the policy module cannot be imported ({why}); fix or remove it")
    if not isinstance(pols, list) or not pols:
        raise fail(where, "policies", "a non-empty list of policy names or mappings", pols)
    resolved = [
        _entry(ctx, f"policies[{i}]", p, tenants, spec, spec_keys) for i, p in enumerate(pols)
    ]
    labels = [p.label for p in resolved]
    if len(set(labels)) != len(labels):
        raise ConfigError(
            f"{where}: policies: labels must be unique (give 'label:'), got {short_repr(labels)}"
        )
    return tuple(resolved)


def _entry(
    ctx: Context,
    key: str,
    p: Any,
    tenants: frozenset[str],
    spec: SpeculativeConfig | None,
    spec_keys: tuple[str, ...],
) -> PolicyConfig:
    where = ctx.where
    if isinstance(p, str):
        p = {"name": p}
    if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
        raise fail(where, key, "a policy name or a mapping with 'name'", p)
    try:
        cls = get_policy(p["name"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {key}: {e}; {how_to_add_a_policy()}") from None
    own = (*cls.options, VICTIM_KEY, ASYNC_KEY)
    allowed = ("name", "label", *LIMIT_KEYS, VICTIM_KEY, ASYNC_KEY, "enable_prefix_caching",
               "speculative", *cls.options)  # fmt: skip
    check_mapping(where, key, p, allowed)
    if ASYNC_KEY in p:
        check_bool(where, f"{key}.{ASYNC_KEY}", p[ASYNC_KEY])
    for k in LIMIT_KEYS:
        check_int(where, f"{key}.{k}", p.get(k), optional=True, hi=MAX_LIMIT)
    if VICTIM_KEY in p:
        check_choice(where, f"{key}.{VICTIM_KEY}", p[VICTIM_KEY], VICTIM_RULES)
    why = cls.check_options({k: v for k, v in p.items() if k in cls.options}, tenants)
    if why:
        raise ConfigError(f"{where}: {key}.{why}")
    caching = p.get("enable_prefix_caching")
    if caching is not None:
        check_bool(where, f"{key}.enable_prefix_caching", caching)
    label = p.get("label", p["name"])
    if not isinstance(label, str) or not LABEL.fullmatch(label):
        raise fail(
            where,
            f"{key}.label",
            "a label of letters, digits, '.', '_', '-', '+' "
            "and spaces, starting with a letter or digit",
            label,
        )
    options = {k: copy.deepcopy(v) for k, v in p.items() if k in own}
    own_spec = "speculative" in p
    try:
        policy_spec = parse_speculative(ctx, f"{key}.speculative", p.get("speculative"))
    except ConfigError as e:  # a partial block: say that it is not merged
        block = p.get("speculative")
        missing = [k for k in spec_keys if isinstance(block, Mapping) and k not in block]
        if not missing:
            raise
        raise ConfigError(
            f"{e} ({key}.speculative replaces the top-level speculative: block whole, "
            f"not key by key; it lacks {', '.join(missing)})"
        ) from None
    return PolicyConfig(
        p["name"],
        label,
        *(p.get(k) for k in LIMIT_KEYS),
        options=MappingProxyType(options),
        enable_prefix_caching=caching,
        speculative=policy_spec if own_spec else spec,
        own_speculative=own_spec,
    )


def parse_speculative(ctx: Context, key: str, raw: Any) -> SpeculativeConfig | None:
    """``speculative:`` validated by lab/core/spec.py, paths made absolute; the path the
    backend reads must exist."""
    if raw is None:
        return None
    try:
        spec = SpeculativeConfig.from_mapping(raw, key)
    except ConfigError as e:
        raise ConfigError(f"{ctx.where}: {e}") from None
    found = {}
    for sub in ("model", "acceptance_from"):
        used = f"speculative.{sub}" in ctx.reads
        value = getattr(spec, sub)
        if sub == "model" and not used and value in MODELS:
            continue  # the simulator takes a model preset's name as it is
        if value is not None:
            path = (
                existing(ctx, f"{key}.{sub}", value, "directory")
                if used
                else paths.resolve(value, ctx.base_dir)
            )
            found[sub] = str(path)
    return dataclasses.replace(spec, **found)
