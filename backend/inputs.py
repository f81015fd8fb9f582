"""Turn one step's per-sequence inputs into the flat tensors the model reads.

A step mixes prefill chunks (several tokens over a cached prefix) and decodes (one token).
Everything is derived from the :class:`SeqInput` list alone: token ids, positions, the slot of
every fed token, block tables, cu_seqlens, and which rows to compute logits for. The
per-token arithmetic runs on the device (positions and slots are gathered from small
per-sequence tensors), so host work is linear in the number of sequences plus one copy of the
token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.attention import AttentionMetadata
from backend.attention.base import prefill_tiles, step_decode_work


@dataclass(slots=True)
class SeqInput:
    """What one sequence feeds in one step.

    Args:
        token_ids: tokens fed this step: a prefill chunk, or the one token of a decode.
        start_pos: = num_computed_tokens; KV for positions [0, start_pos) is already cached.
        block_table: device block ids; must cover start_pos + len(token_ids) positions.
            Position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
            Between steps a list may only be appended to (the lab's BlockManager assigns a
            new list when it frees or swaps): CUDA-graph decode steps restage only the
            entries a known list gained (backend/cuda_graphs.py); a list rewritten in place
            is noticed only if its last staged entry changed.
        sample: sample a next token from the last fed position.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    temperature: float = 0.0


@dataclass(frozen=True)
class StepInputs:
    """The model's inputs for one step.

    Attributes:
        input_ids, positions: (num_tokens,) int64 on the device.
        attn: per-step attention metadata.
        logits_indices: (num_sampled,) int64; row of the last fed token of each sampled seq.
        sampled_seqs: indices into the SeqInput list of the sampled sequences, in order.
        temperatures: one per sampled sequence.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_seqs: list[int]
    temperatures: list[float]


def prepare_inputs(
    seqs: list[SeqInput],
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
    vocab_size: int,
    device: torch.device,
    num_kv_heads: int | None = None,
) -> StepInputs:
    """Validate ``seqs`` (ValueError naming the sequence) and build the step's tensors.

    With ``num_kv_heads`` the metadata also carries the triton decode kernel's work items
    (:func:`backend.attention.base.step_decode_work`); without, that backend builds them."""
    for i, seq in enumerate(seqs):
        check_seq(i, seq, block_size, num_gpu_blocks, max_model_len, vocab_size)
    query_lens = [len(s.token_ids) for s in seqs]
    seq_lens = [s.start_pos + n for s, n in zip(seqs, query_lens, strict=True)]
    query_start = _cumsum(query_lens)
    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables_host = [list(s.block_table) for s in seqs]
    padded = [bt + [0] * (max_blocks - len(bt)) for bt in block_tables_host]
    sampled = [i for i, s in enumerate(seqs) if s.sample]

    def to_device(data: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    input_ids = to_device([t for s in seqs for t in s.token_ids], torch.long)
    query_start_loc = to_device(query_start, torch.int32)
    block_tables = to_device(padded, torch.int32)  # (num_seqs, max_blocks)
    query_lens_t = to_device(query_lens, torch.long)
    start_pos = to_device([s.start_pos for s in seqs], torch.long)

    num_tokens = query_start[-1]
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(seqs), device=device), query_lens_t, output_size=num_tokens
    )
    offset_in_chunk = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token].long()
    positions = start_pos[seq_of_token] + offset_in_chunk  # (num_tokens,)
    blocks = block_tables[seq_of_token, positions // block_size].long()
    slot_mapping = blocks * block_size + positions % block_size

    work = loc = None
    merge = True
    if num_kv_heads is not None and 1 in query_lens:
        w, lc, merge = step_decode_work(query_lens, seq_lens, num_kv_heads)
        work, loc = to_device(w.tolist(), torch.int32), to_device(lc.tolist(), torch.int32)
    attn = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=to_device(seq_lens, torch.int32),
        seq_start_loc=to_device(_cumsum(seq_lens), torch.int32),
        block_tables=block_tables,
        decode_seq_idx=to_device([i for i, n in enumerate(query_lens) if n == 1], torch.int32),
        prefill_seq_idx=to_device([i for i, n in enumerate(query_lens) if n > 1], torch.int32),
        block_size=block_size,
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        block_tables_host=block_tables_host,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        prefill_tiles=torch.from_numpy(prefill_tiles(query_lens)).to(device),
        decode_work=work,
        decode_work_loc=loc,
        decode_merge=merge,
    )
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        attn=attn,
        logits_indices=to_device([query_start[i + 1] - 1 for i in sampled], torch.long),
        sampled_seqs=sampled,
        temperatures=[seqs[i].temperature for i in sampled],
    )


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def check_seq(
    i: int, seq: SeqInput, block_size: int, num_gpu_blocks: int, max_model_len: int, vocab_size: int
) -> None:
    """ValueError naming sequence ``i`` if it cannot run (see :class:`SeqInput`)."""
    where = f"seq {i}"
    if not seq.token_ids:
        raise ValueError(f"{where}: no token_ids to feed")
    if seq.start_pos < 0:
        raise ValueError(f"{where}: start_pos {seq.start_pos} < 0")
    end = seq.start_pos + len(seq.token_ids)
    if end > max_model_len:
        raise ValueError(f"{where}: positions up to {end} exceed max_model_len {max_model_len}")
    needed = -(-end // block_size)
    if len(seq.block_table) < needed:
        raise ValueError(
            f"{where}: block_table has {len(seq.block_table)} blocks, {needed} needed for {end} tokens "
            f"at block_size {block_size}"
        )
    used = seq.block_table[:needed]
    if min(used) < 0 or max(used) >= num_gpu_blocks:
        raise ValueError(
            f"{where}: block ids must be in [0, {num_gpu_blocks}): {seq.block_table[:needed]}"
        )
    if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab_size:
        raise ValueError(f"{where}: token ids must be in [0, {vocab_size})")
    if seq.temperature < 0:
        raise ValueError(f"{where}: temperature {seq.temperature} < 0")
