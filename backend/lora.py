"""LoRA adapters: Hugging Face PEFT folders read to host copies, and GPU slots for a step.

An adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``)
and ``adapter_model.safetensors`` with PEFT's names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``: A (r, in), B (out, r)).
A projection's output becomes ``W x + scaling * B (A x)``, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with ``use_rslora``).

:class:`LoraSlots` holds every adapter on the host and ``max_loras`` device slots: per layer
and fused projection, A stacked (max_loras, slices * rank, in) and B (max_loras, out, rank),
with rank = max_lora_rank rounded up to a power of two >= 16 (zero-padded; the kernels' tile).
The scheduler decides which adapters a step runs; :meth:`LoraSlots.ensure_loaded` brings them
into slots (evicting the least recently used others), and :meth:`LoraSlots.stage` turns the
step's per-sequence adapters into the segments and tiles the kernels read (:mod:`lora_kernels`).
A step where no sequence has an adapter runs no LoRA op at all (:attr:`LoraSlots.active`;
the CUDA graphs keep a LoRA-free variant of each step for it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.errors import CheckpointError
from sched_lab.backend.lora_tiles import TILE_ROWS, Tiling

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
# PEFT target module -> (its block in a layer, the model's fused projection)
TARGETS = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
# fused projection -> its slices in output order
SLICES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoraAdapterError(CheckpointError):
    """An adapter folder is missing, malformed or does not fit the model (names the folder)."""


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT target module -> (in_features, out_features) of the base model's projection."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, config.q_size),
        "k_proj": (h, config.kv_size),
        "v_proj": (h, config.kv_size),
        "o_proj": (config.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def tensor_name(layer: int, module: str, which: str) -> str:
    """PEFT's name of lora_A / lora_B (``which``) of ``module`` in ``layer``."""
    return f"{PREFIX}.{layer}.{TARGETS[module][0]}.{module}.lora_{which}.weight"


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter on the host.

    Attributes:
        weights: (layer, target module) -> (A (rank, in), B (out, rank)), host tensors.
    """

    name: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(
    name: str, folder: str | Path, config: ModelConfig, max_lora_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read and check a PEFT folder against ``config``; LoraAdapterError (one line naming
    the folder) if it cannot run here. Tensors are converted to ``dtype``."""
    folder = Path(folder).expanduser()
    where = f"lora adapter {name!r} ({folder})"
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise LoraAdapterError(f"{where}: no {path.name} (expected a PEFT adapter folder)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraAdapterError(f"{cfg_path}: cannot read JSON ({e})") from None
    rank, alpha, targets = _check_config(raw, cfg_path, max_lora_rank)
    header = _tensor_shapes(weights_path, where)
    shapes = module_shapes(config)
    expected = {}
    for layer in range(config.num_layers):
        for m in targets:
            fan_in, fan_out = shapes[m]
            expected[tensor_name(layer, m, "A")] = (rank, fan_in)
            expected[tensor_name(layer, m, "B")] = (fan_out, rank)
    for t, shape in expected.items():
        if t not in header:
            raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} has no tensor {t} (r={rank})")
        if tuple(header[t]) != shape:
            raise LoraAdapterError(
                f"{where}: {t} has shape {list(header[t])}, expected {list(shape)} "
                f"(r={rank} and the model's projection)"
            )
    extra = sorted(set(header) - set(expected))
    if extra:
        raise LoraAdapterError(
            f"{where}: tensor {extra[0]} is not one of target_modules {list(targets)} "
            f"in layers 0..{config.num_layers - 1}"
        )
    from safetensors.torch import load_file

    tensors = load_file(weights_path)
    weights = {
        (layer, m): (tensors[tensor_name(layer, m, "A")].to(dtype),
                     tensors[tensor_name(layer, m, "B")].to(dtype))
        for layer in range(config.num_layers) for m in targets
    }  # fmt: skip
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return LoraAdapter(name, rank, scaling, targets, weights)


def _tensor_shapes(path: Path, where: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, or LoraAdapterError naming ``where``."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise LoraAdapterError(f"{where}: unreadable {path.name} ({e})") from None


def _check_config(
    raw: object, path: Path, max_lora_rank: int
) -> tuple[int, float, tuple[str, ...]]:
    """(r, lora_alpha, target modules) of an adapter_config.json, or LoraAdapterError."""
    if not isinstance(raw, dict):
        raise LoraAdapterError(f"{path}: expected a JSON object")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{path}: key 'r' must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise LoraAdapterError(f"{path}: r={rank} exceeds max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraAdapterError(f"{path}: key 'lora_alpha' must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise LoraAdapterError(
            f"{path}: key 'target_modules' must be a list of module names, got {targets!r}"
        )
    for m in targets:
        if m not in TARGETS:
            raise LoraAdapterError(
                f"{path}: target module {m!r} is not supported; expected some of {', '.join(TARGETS)}"
            )
    if raw.get("bias", "none") != "none":
        raise LoraAdapterError(f"{path}: bias {raw['bias']!r} is not supported; expected 'none'")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if raw.get(key):
            raise LoraAdapterError(f"{path}: key {key!r} is not supported; expected it unset")
    return rank, float(alpha), tuple(m for m in TARGETS if m in targets)


def adapters_in_dir(adapter_dir: str | Path, names: list[str]) -> dict[str, Path]:
    """name -> ``adapter_dir/name`` for each name; LoraAdapterError naming the first folder
    that does not exist."""
    root = Path(adapter_dir).expanduser()
    if not root.is_dir():
        what = "is a file" if root.exists() else "does not exist"
        raise LoraAdapterError(
            f"lora.adapter_dir {root} {what}; expected a folder of PEFT adapters lora-0, "
            "lora-1, ... (sched-lab tools make-random-lora writes one)"
        )
    out = {}
    for name in names:
        folder = root / name
        if not folder.is_dir():
            raise LoraAdapterError(
                f"lora.adapter_dir {root}: no folder {name!r} (expected one PEFT folder per adapter)"
            )
        out[name] = folder
    return out


def storage_rank(max_lora_rank: int) -> int:
    """Rank of a slot's tensors: max_lora_rank rounded up to a power of two, at least 16."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """Most tiles of TILE_ROWS rows a step of ``num_tokens`` rows over ``num_slots`` slots
    cuts its segments into: each of at most min(slots, tokens) segments leaves under one
    tile partly empty, so sum(ceil(len / 16)) <= (tokens + 15 * segments) // 16."""
    return (num_tokens + (TILE_ROWS - 1) * min(num_slots, num_tokens)) // TILE_ROWS


def lora_segments(slots: np.ndarray, query_lens: np.ndarray, num_slots: int,
                  pad_to: int) -> np.ndarray:  # fmt: skip
    """The kernels' step input, int32, of :func:`segments_size` (pad_to, num_slots):
    ``[seg_start (S) | seg_len (S) | order (pad_to) | tile_slot (M) | tile_first (M) |
    tile_len (M)]``, S = num_slots, M = :func:`max_tiles` (pad_to, S).

    ``slots``: each sequence's slot (-1: none); ``query_lens``: its fed tokens. ``order``
    lists the token rows grouped by slot, rows with no adapter (and padding rows) first,
    outside every segment. Each segment is cut into tiles of TILE_ROWS rows, in slot order:
    tile i is order[tile_first[i] : + tile_len[i]] of slot tile_slot[i]; the unused tiles
    are (0, 0, 0)."""
    token_slot = np.full(pad_to, -1, dtype=np.int64)
    total = int(query_lens.sum())
    token_slot[:total] = np.repeat(slots, query_lens)
    out = np.zeros(segments_size(pad_to, num_slots), dtype=np.int32)
    out[2 * num_slots : 2 * num_slots + pad_to] = np.argsort(token_slot, kind="stable")
    counts = np.bincount(token_slot + 1, minlength=num_slots + 1)
    starts = np.cumsum(counts)[:-1]  # slot s starts after every row of a smaller slot
    lens = counts[1:]
    out[:num_slots] = starts
    out[num_slots : 2 * num_slots] = lens
    per_slot = -(-lens // TILE_ROWS)
    tile_slot = np.repeat(np.arange(num_slots), per_slot)
    nth = np.arange(tile_slot.size) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
    m, base = max_tiles(pad_to, num_slots), 2 * num_slots + pad_to
    for k, column in enumerate((tile_slot, starts[tile_slot] + nth * TILE_ROWS,
                                np.minimum(TILE_ROWS, lens[tile_slot] - nth * TILE_ROWS))):  # fmt: skip
        out[base + k * m : base + k * m + tile_slot.size] = column
    return out


def segments_size(num_tokens: int, num_slots: int) -> int:
    """Length of :func:`lora_segments`' array for ``num_tokens`` rows and ``num_slots``."""
    return 2 * num_slots + num_tokens + 3 * max_tiles(num_tokens, num_slots)


@dataclass(frozen=True)
class LoraOptions:
    """How :class:`LoraSlots` runs the adapters' deltas (the defaults serve;
    benchmarks/lora_step.py compares others).

    Attributes:
        grid: "tiles": the kernels' programs cover the step's tiles (at most
            :func:`max_tiles` rows of programs); "slots": cdiv(T, 16) rows of programs for
            every slot, the empty ones returning at once.
        skip_idle: a step where no sequence has an adapter runs no LoRA op (eagerly, and in
            a LoRA-free variant of each CUDA graph); False runs the kernels on no segment.
        tiling: tile sizes of the tiles grid.
    """

    grid: str = "tiles"
    skip_idle: bool = True
    tiling: Tiling = field(default_factory=Tiling)

    def __post_init__(self) -> None:
        if self.grid not in ("tiles", "slots"):
            raise ValueError(f"lora options: grid must be 'tiles' or 'slots', got {self.grid!r}")


@dataclass
class ProjectionLora:
    """One fused projection's slots: a (slots, slices * rank, in), b (slots, out, rank),
    bounds (slices + 1,) int32 column offsets of the slices in the output."""

    a: torch.Tensor
    b: torch.Tensor
    bounds: torch.Tensor
    bounds_host: list[int]


class LoraSlots:
    """Host copies of every adapter and ``max_loras`` device slots (see the module doc).

    Args:
        adapters: name -> PEFT folder (or an in-memory :class:`LoraAdapter`, for benchmarks).
        kernels: run the Triton kernels (CUDA, or the interpreter); else the torch reference.
        options: grid, idle skipping and tiling (None: :class:`LoraOptions`' defaults).
    """

    def __init__(self, config: ModelConfig, adapters: dict[str, Path | LoraAdapter],
                 max_loras: int, max_lora_rank: int, device: torch.device, dtype: torch.dtype,
                 kernels: bool, options: LoraOptions | None = None) -> None:  # fmt: skip
        if max_loras < 1 or max_lora_rank < 1:
            raise LoraAdapterError(
                f"lora: max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1"
            )
        self.adapters = {
            name: a if isinstance(a, LoraAdapter)
            else read_adapter(name, a, config, max_lora_rank, dtype)
            for name, a in adapters.items()
        }  # fmt: skip
        for a in self.adapters.values():
            if a.rank > max_lora_rank:
                raise LoraAdapterError(f"lora adapter {a.name!r}: r={a.rank} exceeds "
                                       f"max_lora_rank {max_lora_rank}")  # fmt: skip
        self.max_loras, self.rank, self.device = max_loras, storage_rank(max_lora_rank), device
        self.kernels = kernels
        self.options = options or LoraOptions()
        targeted = {m for a in self.adapters.values() for m in a.targets}
        shapes = module_shapes(config)
        # layer -> fused projection -> its slots; projections no adapter targets are left out
        self.layers: list[dict[str, ProjectionLora]] = []
        for _ in range(config.num_layers):
            layer = {}
            for proj, parts in SLICES.items():
                if not targeted & set(parts):
                    continue
                fan_in = shapes[parts[0]][0]
                bounds = [0, *np.cumsum([shapes[p][1] for p in parts]).tolist()]
                layer[proj] = ProjectionLora(
                    torch.zeros(max_loras, len(parts) * self.rank, fan_in, dtype=dtype, device=device),
                    torch.zeros(max_loras, bounds[-1], self.rank, dtype=dtype, device=device),
                    torch.tensor(bounds, dtype=torch.int32, device=device),
                    bounds,
                )  # fmt: skip
            self.layers.append(layer)
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.slot_names: list[str | None] = [None] * max_loras
        self.last_used = [0] * max_loras
        self.steps = 0
        empty = lora_segments(np.zeros(0, np.int64), np.zeros(0, np.int64), max_loras, 0)
        self.batch = torch.from_numpy(empty).to(device)  # no step staged yet: no segment
        self.slot_of_token = torch.zeros(0, dtype=torch.long)  # the torch reference's input
        # whether the layers add adapter deltas: set by each staged step (needed()), and by
        # the CUDA graphs for the variant they capture
        self.active = False

    # -- residency ------------------------------------------------------------------------

    def ensure_loaded(self, names: list[str]) -> dict[str, int]:
        """Bring the step's adapters (``""``: none) into slots; name -> slot. Mutates the
        slots (least recently used adapters not in ``names`` are evicted); ValueError for an
        unknown name or more distinct adapters than ``max_loras``."""
        self.steps += 1
        wanted = sorted(set(names) - {""})
        for name in wanted:
            if name not in self.adapters:
                known = ", ".join(sorted(self.adapters)) or "none"
                raise ValueError(f"lora: unknown adapter {name!r}; loaded: {known}")
        if len(wanted) > self.max_loras:
            raise ValueError(
                f"lora: a step runs {len(wanted)} adapters, more than max_loras {self.max_loras}"
            )
        where = {n: s for s, n in enumerate(self.slot_names) if n is not None}
        for name in wanted:
            if name not in where:
                free = [s for s, n in enumerate(self.slot_names) if n is None or n not in wanted]
                slot = min(free, key=lambda s: (self.slot_names[s] is not None, self.last_used[s]))
                self.load(slot, name)
                where = {n: s for s, n in enumerate(self.slot_names) if n is not None}
            self.last_used[where[name]] = self.steps
        return {n: where[n] for n in wanted}

    def load(self, slot: int, name: str) -> None:
        """Copy adapter ``name``'s host tensors into ``slot`` (zero-padding its rank)."""
        adapter = self.adapters[name]
        r = adapter.rank
        for i, layer in enumerate(self.layers):
            for proj, w in layer.items():
                w.a[slot].zero_()
                w.b[slot].zero_()
                for k, part in enumerate(SLICES[proj]):
                    pair = adapter.weights.get((i, part))
                    if pair is None:
                        continue
                    lo, hi = w.bounds_host[k], w.bounds_host[k + 1]
                    w.a[slot, k * self.rank : k * self.rank + r].copy_(pair[0], non_blocking=True)
                    w.b[slot, lo:hi, :r].copy_(pair[1], non_blocking=True)
        self.scale[slot] = adapter.scaling
        self.slot_names[slot] = name

    # -- per step -------------------------------------------------------------------------

    def needed(self, names: Sequence[str]) -> bool:
        """Whether a step whose sequences run ``names`` (``""``: none) runs LoRA ops: some
        sequence has an adapter, or ``options.skip_idle`` is off."""
        return not self.options.skip_idle or any(names)

    def stage(self, names: list[str], query_lens: np.ndarray, pad_to: int,
              into: torch.Tensor | None = None) -> None:  # fmt: skip
        """Load the step's adapters and make its segments (``names``: per sequence, ``""``:
        none; ``pad_to``: token rows) the current batch: copied into ``into`` (a CUDA graph's
        static buffer) or into a fresh device tensor. Sets :attr:`active`."""
        self.active = self.needed(names)
        slot = self.ensure_loaded(names)
        seq_slots = np.fromiter((slot.get(n, -1) for n in names), dtype=np.int64, count=len(names))
        host = lora_segments(seq_slots, query_lens, self.max_loras, pad_to)
        if not self.kernels:
            token = np.full(pad_to, -1, dtype=np.int64)
            token[: int(query_lens.sum())] = np.repeat(seq_slots, query_lens)
            self.slot_of_token = torch.from_numpy(token).to(self.device)
        staged = self._pinned(host)
        if into is None:
            self.batch = staged.to(self.device, non_blocking=True)
        else:
            into[: host.size].copy_(staged, non_blocking=True)
            self.batch = into

    def static_buffer(self, max_tokens: int) -> torch.Tensor:
        """A zeroed device buffer for graph steps of up to ``max_tokens`` rows (no segment)."""
        size = segments_size(max_tokens, self.max_loras)
        return torch.zeros(size, dtype=torch.int32, device=self.device)

    def _pinned(self, host: np.ndarray) -> torch.Tensor:
        """``host`` in a host tensor (pinned for CUDA, so its copy does not wait)."""
        staged = torch.empty(host.size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        staged.numpy()[:] = host
        return staged

    # -- the model's side -----------------------------------------------------------------

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each row's adapter delta for fused projection ``proj`` of ``layer`` (in place;
        returns y); y untouched while not :attr:`active`. x: (T, in); y: (T, out), the base
        projection's output; T the staged step's rows."""
        w = self.layers[layer].get(proj)
        if w is None or not self.active:
            return y
        from sched_lab.backend import lora_kernels as lk

        num_tokens, slots = x.shape[0], self.max_loras
        if not self.kernels:
            slot_of = self.slot_of_token[:num_tokens]
            xr = torch.zeros(num_tokens, w.a.shape[1], dtype=torch.float32, device=x.device)
            lk.shrink_ref(x, w.a, slot_of, xr)
            return lk.expand_ref(y, xr, w.b, self.scale, w.bounds_host, slot_of)
        seg_start, seg_len = self.batch[:slots], self.batch[slots : 2 * slots]
        order = self.batch[2 * slots : 2 * slots + num_tokens]
        if self.options.grid == "slots":
            xr_parts = lk.shrink(x, w.a, order, seg_start, seg_len)
            return lk.expand(y, xr_parts, w.b, self.scale, w.bounds, order, seg_start, seg_len)
        m, base = max_tiles(num_tokens, slots), 2 * slots + num_tokens
        tiles = self.batch[base : base + 3 * m].view(3, m)  # slot, first, len of each tile
        tiling = self.options.tiling
        xr_parts = lk.shrink_tiles(x, w.a, order, *tiles, tiling=tiling)
        return lk.expand_tiles(y, xr_parts, w.b, self.scale, w.bounds, order, *tiles,
                               tiling=tiling)  # fmt: skip
