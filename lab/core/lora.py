"""LoRA adapter slots of one replica (vLLM's ``--max-loras`` / ``--max-cpu-loras``).

Rules (docs/lora.md):

* A step runs at most ``max_loras`` distinct adapters (the base model, ``lora_name`` "",
  takes no slot). An adapter is *pinned* while a request using it is running or swapped;
  a waiting request whose adapter is not pinned is admitted only while fewer than
  ``max_loras`` adapters are pinned, else it is skipped this step (vLLM's rule), and the
  requests behind it may still be admitted.
* GPU residency: ``max_loras`` slots, least recently used first out (never a pinned one).
  An adapter not in a GPU slot is *loaded* when a request using it is admitted: the step
  that admits it pays the load (the cost model prices ``num_lora_loads``).
* Host residency: an LRU of ``max_cpu_loras`` adapters (those on the GPU included);
  an adapter evicted from the GPU stays there until the LRU drops it. Routers read it
  (:meth:`LoRASlots.residency`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

GPU, HOST, ABSENT = 2, 1, 0  # what :meth:`LoRASlots.residency` returns


def adapter_names(num_adapters: int) -> tuple[str, ...]:
    """The adapters a ``lora:`` section configures: ``lora-0`` .. ``lora-{N-1}``."""
    return tuple(f"lora-{i}" for i in range(num_adapters))


class LoRASlots:
    """Which adapters sit in GPU slots and in the host LRU; mutated by admissions.

    Args:
        adapters: the known adapter names (a request naming another is rejected).
        max_loras: GPU slots (>= 1).
        max_cpu_loras: host LRU capacity (>= ``max_loras``).

    Attributes:
        num_loads: adapters loaded into a GPU slot so far.
    """

    def __init__(self, adapters: Iterable[str], max_loras: int, max_cpu_loras: int) -> None:
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"max_loras {max_loras}, max_cpu_loras {max_cpu_loras}")
        self.adapters = frozenset(adapters)
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.gpu: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.host: OrderedDict[str, None] = OrderedDict()
        self.num_loads = 0

    def fits(self, name: str, pinned: set[str]) -> bool:
        """Whether a request of adapter ``name`` may join a batch whose running and swapped
        requests use ``pinned`` adapters (the base model always may)."""
        return not name or name in pinned or len(pinned) < self.max_loras

    def acquire(self, name: str, pinned: set[str]) -> bool:
        """Make ``name`` resident in a GPU slot, evicting the least recently used adapter
        not in ``pinned``; True if it had to be loaded. The caller checked :meth:`fits`.
        Mutates the slots and the host LRU."""
        if name in self.gpu:
            self.gpu.move_to_end(name)
            self.host.move_to_end(name)
            return False
        if len(self.gpu) >= self.max_loras:
            victim = next(a for a in self.gpu if a not in pinned)
            del self.gpu[victim]  # it stays in the host LRU
        self.gpu[name] = None
        self.host[name] = None
        self.host.move_to_end(name)
        while len(self.host) > self.max_cpu_loras:
            del self.host[next(a for a in self.host if a not in self.gpu)]
        self.num_loads += 1
        return True

    def residency(self, name: str) -> int:
        """:data:`GPU`, :data:`HOST` or :data:`ABSENT` for adapter ``name``."""
        return GPU if name in self.gpu else HOST if name in self.host else ABSENT

    def unknown_reason(self, name: str) -> str | None:
        """Why a request naming adapter ``name`` can never run here, or None."""
        if not name or name in self.adapters:
            return None
        return (
            f"LoRA adapter {name!r} is not one of the {len(self.adapters)} configured "
            f"(lora.num_adapters: lora-0 .. lora-{len(self.adapters) - 1})"
        )
