"""Prefix identity of trace requests: Mooncake's hash ids and their block size, the
``prefix:`` generator (system prompts, multi-turn sessions), prompt tokens made from hash
ids, and the infinite-cache bound of the hit rate. Every expected value is worked out by
hand in the comments; bad inputs are one exact line each."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from sched_lab.cli import main as cli_main
from sched_lab.config import validate
from sched_lab.core.errors import ConfigError, TraceError
from sched_lab.core.request import Request
from sched_lab.traces import load_trace
from sched_lab.traces.hash_tokens import assign_hash_prompt_tokens, prompt_tokens_from_hash_ids
from sched_lab.traces.prefix_bound import prefix_hit_bound

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = "traces/data/mooncake_conversation_trace.jsonl"
SYNTHETIC = {
    "format": "synthetic",
    "num_requests": 3,
    "arrival": {"rate": math.inf},  # every first turn at 0
    "prompt_len": 20,
    "output_len": 20,
}


def error(spec: Any) -> str:
    with pytest.raises(TraceError) as info:
        load_trace(spec, ROOT)
    message = str(info.value)
    assert "\n" not in message
    return message


def mooncake_file(tmp_path: Path, *lines: dict) -> str:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def row(hash_ids: Any, prompt: int = 600, output: int = 5, t: int = 0) -> dict:
    return {"timestamp": t, "input_length": prompt, "output_length": output, "hash_ids": hash_ids}


# --- Mooncake: hash_block_size and the hash_ids rule -----------------------------------


def test_shipped_mooncake_keeps_its_ids_at_512() -> None:
    requests = load_trace({"format": "mooncake", "path": MOONCAKE}, ROOT)
    assert {r.hash_block_size for r in requests} == {512}
    assert requests[1].hash_ids == [0, *range(14, 28)]  # 7322 tokens: ceil(7322/512) = 15


def test_mooncake_hash_block_size_option(tmp_path: Path) -> None:
    # 600 + 5 tokens at 300 per id: at least ceil(600/300) = 2 ids, at most ceil(605/300) = 3.
    path = mooncake_file(tmp_path, row([7, 8]), row([7, 8, 9], t=1000))
    requests = load_trace({"format": "mooncake", "path": path, "hash_block_size": 300}, ROOT)
    assert [(r.hash_ids, r.hash_block_size) for r in requests] == [([7, 8], 300), ([7, 8, 9], 300)]


@pytest.mark.parametrize(
    ("ids", "block", "message"),
    [
        ("abc", 512, "expected a list of integers, got 'abc'"),
        ([1, True], 512, "expected a list of integers, got [1, true]"),
        ([1, 2.0], 512, "expected a list of integers, got [1, 2.0]"),
        ([[1], 2], 512, "expected a list of integers, got [[1], 2]"),
        ([1, -2], 512, "expected hash ids in 0..2**63-1, got -2 at position 2"),
        ([2**63], 512, "expected hash ids in 0..2**63-1, got 9223372036854775808 at position 1"),
        # 600 tokens need ceil(600/512) = 2 ids, or ceil(600/256) = 3 at 256 per id
        ([], 512, "expected at least ceil(prompt 600 / hash_block_size 512) = 2 hash ids "
                  "(one per block of the prompt), got 0"),
        ([7, 8], 256, "expected at least ceil(prompt 600 / hash_block_size 256) = 3 hash ids "
                      "(one per block of the prompt), got 2"),
        # 605 tokens at 1024 per id: at most 1 id
        ([7, 8], 1024, "expected at most ceil((prompt 600 + output 5) / hash_block_size "
                       "1024) = 1 hash ids (blocks of the prompt and the output), got 2; is "
                       "trace.hash_block_size right?"),
    ],
)  # fmt: skip
def test_bad_mooncake_hash_ids(tmp_path: Path, ids: Any, block: int, message: str) -> None:
    path = mooncake_file(tmp_path, row([1], prompt=10), row(ids, t=5))  # line 1 fits any size
    spec = {"format": "mooncake", "path": path, "hash_block_size": block}
    assert error(spec) == f"m.jsonl: line 2, key 'hash_ids': {message}"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"format": "mooncake", "path": MOONCAKE, "hash_block_size": 0},
         "trace.hash_block_size: expected an integer >= 1, got 0 (int)"),
        ({"format": "mooncake", "path": MOONCAKE, "hash_block_size": -512},
         "trace.hash_block_size: expected an integer >= 1, got -512 (int)"),
        ({**SYNTHETIC, "hash_block_size": 16.0, "prefix": {}},
         "trace.hash_block_size: expected an integer >= 1, got 16.0 (float)"),
        ({"format": "azure2023", "path": "traces/data/azure2023_code.csv", "hash_block_size": 16},
         "trace.hash_block_size: format azure2023 has no hash ids (give a prefix: block to "
         "make them)"),
        ({"format": "mooncake", "path": MOONCAKE, "prefix": {}},
         "trace.prefix: not with format mooncake: its rows have hash_ids, its own prefix "
         "identity"),
    ],
)  # fmt: skip
def test_bad_hash_block_size_in_the_trace(spec: dict, message: str) -> None:
    assert error(spec) == message


@pytest.mark.parametrize(
    ("trace", "kv", "message"),
    [
        ({"format": "mooncake", "path": MOONCAKE, "hash_block_size": 500}, {},
         "config: trace.hash_block_size: 500 is not a multiple of kv_cache.block_size 16; "
         "expected a multiple, so that every KV block lies inside one hash block"),
        ({**SYNTHETIC, "prefix": {}}, {"block_size": 32},
         "config: trace.hash_block_size: 16 (the default for trace.prefix) is not a multiple "
         "of kv_cache.block_size 32; expected a multiple, so that every KV block lies inside "
         "one hash block"),
        ({**SYNTHETIC, "prefix": {}, "hash_block_size": 0}, {},
         "config: trace.hash_block_size: expected an integer >= 1, got 0"),
        ({**SYNTHETIC, "prefix": {}, "hash_block_size": "16"}, {},
         "config: trace.hash_block_size: expected an integer >= 1, got '16'"),
    ],
)  # fmt: skip
def test_hash_block_size_against_the_kv_block_size(trace: dict, kv: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate({"trace": trace, "kv_cache": kv})
    assert str(info.value) == message


def test_hash_block_size_multiples_are_accepted() -> None:
    cfg = validate({"trace": {**SYNTHETIC, "prefix": {}, "hash_block_size": 64}})
    assert cfg.trace.spec["hash_block_size"] == 64
    # Mooncake's default 512 with block size 48 (no caching asked): unchanged behaviour
    cfg = validate(
        {"trace": {"format": "mooncake", "path": MOONCAKE}, "kv_cache": {"block_size": 48}}
    )
    assert cfg.kv_cache.block_size == 48


# --- the prefix generator ---------------------------------------------------------------

SESSIONS = {
    **SYNTHETIC,
    "hash_block_size": 16,
    "prefix": {
        "prefix_len": 40,
        "num_prefixes": 2,
        "assign": "round_robin",
        "num_turns": 2,
        "think_time_s": 5.0,
        "user_len": 10,
        "output_len": 8,
    },
}


def test_sessions_with_system_prompts_by_hand() -> None:
    # System prompt: 40 tokens = 2 full blocks of 16 (the 3rd block mixes it with the user
    # message). Group 0 has ids 0, 1; group 1 ids 2, 3; session ids start at 4.
    # Turn 1: 40 + 20 = 60 prompt, 20 output: ceil(80/16) = 5 ids. Turn 2: 60 + 20 + 10 = 90
    # prompt, 8 output: ceil(98/16) = 7 ids, of which 7 - 2 = 5 are the session's own.
    # Sessions 0, 1, 2 get groups 0, 1, 0 (round robin); turn 2 arrives at 0 + 5 s, and the
    # follow-ups are numbered 3, 4, 5 after the 3 rows.
    requests = load_trace(SESSIONS, ROOT)
    got = [(r.request_id, r.arrival_s, r.prompt_len, r.output_len, r.hash_ids) for r in requests]
    assert got == [
        ("0", 0.0, 60, 20, [0, 1, 4, 5, 6]),
        ("1", 0.0, 60, 20, [2, 3, 9, 10, 11]),
        ("2", 0.0, 60, 20, [0, 1, 14, 15, 16]),
        ("3", 5.0, 90, 8, [0, 1, 4, 5, 6, 7, 8]),
        ("4", 5.0, 90, 8, [2, 3, 9, 10, 11, 12, 13]),
        ("5", 5.0, 90, 8, [0, 1, 14, 15, 16, 17, 18]),
    ]
    assert {r.hash_block_size for r in requests} == {16}


def test_follow_up_lengths_default_to_the_first_turn() -> None:
    # No user_len/output_len: turn t+1 = P(t) + O(t) + 20, output 20; no system prompt.
    # P = 20, 60, 100; arrivals 0, 2, 4; ids: ceil(40/16) = 3, ceil(80/16) = 5, 8.
    spec = {**SYNTHETIC, "num_requests": 1, "prefix": {"num_turns": 3, "think_time_s": 2}}
    requests = load_trace(spec, ROOT)
    got = [(r.request_id, r.arrival_s, r.prompt_len, r.output_len, r.hash_ids) for r in requests]
    assert got == [
        ("0", 0.0, 20, 20, [0, 1, 2]),
        ("1", 2.0, 60, 20, [0, 1, 2, 3, 4]),
        ("2", 4.0, 100, 20, [0, 1, 2, 3, 4, 5, 6, 7]),
    ]


def test_turns_interleave_by_arrival_and_limit_counts_turns() -> None:
    # The Azure code trace's first rows arrive at 0, 0.052, 0.098189 s (4808, 3180, 110
    # prompt tokens; 10, 8, 27 output). Turn 2 of row 0 arrives at 0.05, before row 1; the
    # follow-ups are numbered after the file's 8,819 rows. limit 4 keeps 4 requests, turns
    # included: rows 0, 8819 (turn 2 of row 0: 4808 + 10 + 4808 tokens), 1, 2.
    spec = {
        "format": "azure2023",
        "path": "traces/data/azure2023_code.csv",
        "limit": 4,
        "prefix": {"num_turns": 2, "think_time_s": 0.05},
    }
    got = [(r.request_id, r.arrival_s, r.prompt_len, r.output_len) for r in load_trace(spec, ROOT)]
    assert got == [
        ("0", 0.0, 4808, 10),
        ("8819", 0.05, 9626, 10),
        ("1", pytest.approx(0.052), 3180, 8),
        ("2", pytest.approx(0.098189), 110, 27),
    ]


def test_dropped_rows_start_no_session(tmp_path: Path) -> None:
    # BurstGPT row 2 failed (0 response tokens): it stays dropped, without ids or turns.
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0,ChatGPT,10,5,15,Conversation log\n"
        "1,ChatGPT,10,0,10,Conversation log\n"
        "2,ChatGPT,30,7,37,Conversation log\n"
    )
    spec = {"format": "burstgpt", "path": str(path), "prefix": {"num_turns": 2, "think_time_s": 10}}
    requests = load_trace(spec, ROOT)
    got = [(r.request_id, r.status.value, r.prompt_len, r.hash_ids) for r in requests]
    # Row 0: 10 + 5 = 15 tokens, 1 id; its turn 2 (id 3, the rows' last is 2): 10 + 5 + 10 =
    # 25 prompt + 5 output = 2 ids. Row 2: own ids start after row 0's session (0, 1).
    assert got == [
        ("0", "waiting", 10, [0]),
        ("1", "dropped", 10, None),
        ("2", "waiting", 30, [2, 3, 4]),
        ("3", "waiting", 25, [0, 1]),
        ("4", "waiting", 30 + 7 + 30, [2, 3, 4, 5, 6]),
    ]


def test_random_assignment_is_seeded() -> None:
    spec = {
        **SYNTHETIC,
        "num_requests": 40,
        "prefix": {"prefix_len": 32, "num_prefixes": 3},
    }  # 2 shared blocks per system prompt: ids (0, 1), (2, 3) or (4, 5)
    a, b = load_trace(spec, ROOT), load_trace(spec, ROOT)
    assert [r.hash_ids for r in a] == [r.hash_ids for r in b]
    heads = [tuple(r.hash_ids[:2]) for r in a]
    assert set(heads) == {(0, 1), (2, 3), (4, 5)}
    other = load_trace({**spec, "seed": 1}, ROOT)
    assert [tuple(r.hash_ids[:2]) for r in other] != heads
    # The format's own draws do not move: same arrivals and lengths as without prefix.
    plain = load_trace({**SYNTHETIC, "num_requests": 40}, ROOT)
    assert [r.prompt_len - 32 for r in a] == [r.prompt_len for r in plain]


def test_prefix_without_sharing_gives_every_request_its_own_ids() -> None:
    requests = load_trace({**SYNTHETIC, "prefix": {}}, ROOT)
    assert [r.hash_ids for r in requests] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ([1], "trace.prefix: expected a mapping, got [1] (list)"),
        ({"x": 1}, "trace.prefix: unknown key 'x'; allowed keys: assign, num_prefixes, "
                   "num_turns, output_len, prefix_len, think_time_s, user_len"),
        ({"prefix_len": -1}, "trace.prefix.prefix_len: expected an integer >= 0, got -1 (int)"),
        ({"prefix_len": True}, "trace.prefix.prefix_len: expected an integer >= 0, got True (bool)"),
        ({"prefix_len": 8, "num_prefixes": 0},
         "trace.prefix.num_prefixes: expected an integer >= 1, got 0 (int)"),
        ({"num_prefixes": 2},
         "trace.prefix.num_prefixes: there is no system prompt to share (set prefix_len > 0)"),
        ({"prefix_len": 8, "assign": "zipf"},
         "trace.prefix.assign: expected one of random, round_robin; got 'zipf' (str)"),
        ({"num_turns": 0}, "trace.prefix.num_turns: expected an integer, {uniform: [lo, hi]} "
                           "or {choice: [...]} of turns in 1..1000, got 0"),
        ({"num_turns": {"uniform": [2, 1001]}, "think_time_s": 1},
         "trace.prefix.num_turns: expected an integer, {uniform: [lo, hi]} or {choice: [...]} "
         "of turns in 1..1000, got {'uniform': [2, 1001]}"),
        ({"num_turns": 3}, "trace.prefix: missing key 'think_time_s' (seconds from a turn's "
                           "arrival to the next turn's), needed when num_turns allows more "
                           "than 1 turn"),
        ({"num_turns": 2, "think_time_s": -1},
         "trace.prefix.think_time_s: expected a number >= 0 (finite), got -1 (int)"),
        ({"num_turns": 2, "think_time_s": math.nan},
         "trace.prefix.think_time_s: expected a number >= 0 (finite), got nan (float)"),
        ({"num_turns": 2, "think_time_s": {"exponential": 0}},
         "trace.prefix.think_time_s.exponential: expected a number > 0 (finite), got 0 (int)"),
        ({"num_turns": 2, "think_time_s": {"uniform": [5, 1]}},
         "trace.prefix.think_time_s.uniform: expected [lo_s, hi_s], finite, 0 <= lo_s <= "
         "hi_s, got [5, 1]"),
        ({"num_turns": 2, "think_time_s": "soon"},
         "trace.prefix.think_time_s: expected a number of seconds >= 0, {exponential: "
         "mean_s} or {uniform: [lo_s, hi_s]}, got 'soon'"),
        ({"user_len": 5}, "trace.prefix.user_len: only for follow-up turns; num_turns allows "
                          "1 turn"),
        ({"num_turns": 2, "think_time_s": 1, "output_len": {"uniform": [5, 1]}},
         "trace.prefix.output_len.uniform: expected lo <= hi, got [5, 1]"),
    ],
)  # fmt: skip
def test_bad_prefix_options(prefix: Any, message: str) -> None:
    assert error({**SYNTHETIC, "prefix": prefix}) == message


def test_prefix_with_prompts_is_refused() -> None:
    spec = {"format": "prompts", "path": "x.yaml", "tokenizer": "t", "prefix": {}}
    assert error(spec) == (
        "trace.prefix: not with format prompts: its prompts are real token ids, its own "
        "prefix identity"
    )


# --- prompt tokens from hash ids ----------------------------------------------------------


def test_shared_ids_give_shared_tokens() -> None:
    # Two prompts of 40 tokens at 16 per id sharing their first k = 2 ids: tokens 0..31
    # are equal, tokens 32..39 (blocks 9 and 3) differ.
    a = prompt_tokens_from_hash_ids([5, 7, 9], 40, 16, 1000, seed=0)
    b = prompt_tokens_from_hash_ids([5, 7, 3, 4], 40, 16, 1000, seed=0)
    assert len(a) == len(b) == 40 and all(0 <= t < 1000 for t in a + b)
    assert a[:32] == b[:32] and a[32:] != b[32:]
    # An id's block is the same wherever it appears, in every call (every run).
    c = prompt_tokens_from_hash_ids([9], 16, 16, 1000, seed=0)
    assert c == a[32:] + prompt_tokens_from_hash_ids([9], 16, 16, 1000, seed=0)[8:]
    assert prompt_tokens_from_hash_ids([5], 16, 16, 1000, seed=1) != a[:16]  # seeded


def test_assign_hash_prompt_tokens_leaves_text_and_plain_requests() -> None:
    shared = Request("0", 0.0, 20, 1, hash_ids=[1, 2], hash_block_size=16)
    turn = Request("1", 0.0, 40, 1, hash_ids=[1, 2, 3], hash_block_size=16)
    text = Request("2", 0.0, 2, 1, prompt_token_ids=[7, 8], hash_ids=[1])
    plain = Request("3", 0.0, 5, 1)
    assign_hash_prompt_tokens([shared, turn, text, plain], 50, seed=0)
    assert shared.prompt_token_ids == turn.prompt_token_ids[:20]
    assert len(turn.prompt_token_ids) == 40
    assert text.prompt_token_ids == [7, 8] and plain.prompt_token_ids is None


def test_engine_replays_prompts_made_from_hash_ids(tmp_path: Path) -> None:
    """The engine path (lab/run/experiment.py) gives requests with hash ids and no text their
    tokens from the ids: two requests behind one 32-token system prompt share 32 tokens."""
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
    import torch_threads  # noqa: F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.run.experiment import run_experiment

    model = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 128,
    }
    write_random_checkpoint(model, tmp_path, dtype="float32")
    trace = {**SYNTHETIC, "num_requests": 2, "prompt_len": 8, "output_len": 2}
    cfg = validate({
        "backend": "engine",
        "seed": 3,
        "trace": {**trace, "prefix": {"prefix_len": 32}},
        "engine": {"model_path": str(tmp_path), "device": "cpu", "dtype": "float32"},
        "kv_cache": {"block_size": 16, "num_gpu_blocks": 16, "swap_space_gib": 0.001},
        "scheduler": {"max_model_len": 64},
        "policies": ["fcfs"],
    })  # fmt: skip
    (run,) = run_experiment(cfg, progress=False)
    a, b = sorted(run.result.requests, key=lambda r: r.request_id)
    assert (a.hash_ids, b.hash_ids) == ([0, 1, 2], [0, 1, 3])  # 40 + 2 tokens: 3 ids each
    assert a.prompt_token_ids == prompt_tokens_from_hash_ids([0, 1, 2], 40, 16, 100, seed=3)
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32]
    assert a.prompt_token_ids[32:] != b.prompt_token_ids[32:]
    assert [len(r.output_token_ids) for r in (a, b)] == [2, 2]


def test_too_few_ids_for_tokens() -> None:
    with pytest.raises(ValueError, match="1 hash ids of 16 tokens cannot make a prompt of 17"):
        prompt_tokens_from_hash_ids([1], 17, 16, 100, seed=0)


# --- the infinite-cache bound ---------------------------------------------------------------


def req(i: int, prompt: int, output: int, ids: list[int] | None, block: int = 32) -> Request:
    return Request(str(i), float(i), prompt, output, hash_ids=ids, hash_block_size=block)


def test_bound_by_hand() -> None:
    # KV blocks of 16, hash blocks of 32 (2 KV blocks each).
    # r0: 70 + 10 tokens, ids 1 2 3: nothing seen; writes 79 tokens = 4 full KV blocks
    #     (both of hash 1, both of hash 2; hash 3 has tokens 64..78: none full).
    # r1: 50 tokens, ids 1 2: at most (50-1)//16 = 3 blocks: 2 of hash 1, 1 of hash 2 = 48.
    # r2: 64 tokens, ids 1 5: 2 of hash 1, then (1, 5) is unseen: 32. It writes 64 + 1 - 1
    #     = 64 tokens: hash 5 after hash 1 is now seen, both KV blocks.
    # r3: 64 tokens, ids 9 2: hash 2 after 9 is other content: 0.
    # r4: 32 tokens, ids 1: a prompt of exactly 2 blocks reuses at most (32-1)//16 = 1: 16.
    # r5: 96 tokens, ids 1 5 7: hash 1, hash 5 (seen through r2): 4 blocks = 64.
    requests = [
        req(0, 70, 10, [1, 2, 3]),
        req(1, 50, 1, [1, 2]),
        req(2, 64, 1, [1, 5]),
        req(3, 64, 1, [9, 2]),
        req(4, 32, 1, [1]),
        req(5, 96, 1, [1, 5, 7]),
        req(6, 10, 1, None),  # no ids: counts its prompt, reuses nothing
    ]
    bound = prefix_hit_bound(requests, block_size=16)
    assert bound.cached_tokens == [0, 48, 32, 0, 16, 64, 0]
    assert bound.prompt_tokens == 70 + 50 + 64 + 64 + 32 + 96 + 10 == 386
    assert bound.hit_rate == 160 / 386
    assert bound.num_with_hash_ids == 6
    # max_model_len 79 skips r0 (80 tokens) and r5 (97): nothing is cached before r1 then,
    # so r1 only writes (50 tokens: 3 blocks); r2 reuses hash 1's 2 blocks; r4 reuses 1.
    capped = prefix_hit_bound(requests, block_size=16, max_model_len=79)
    assert capped.request_ids == ["1", "2", "3", "4", "6"]
    assert capped.cached_tokens == [0, 32, 0, 16, 0]


def test_bound_keeps_adapters_and_cache_salts_apart() -> None:
    # KV blocks of 16, hash blocks of 32. r0 (salt s, 70 + 10 tokens, ids 1 2 3) writes 4
    # blocks. r1 (ids 1 2, 50 tokens: at most 3 blocks) finds them under salt s only: 48;
    # under salt u, or with adapter x and salt s, nothing.
    def salted(i, lora_name="", cache_salt="s"):
        r = req(i, 70 if i == 0 else 50, 10 if i == 0 else 1, [1, 2, 3] if i == 0 else [1, 2])
        r.lora_name, r.cache_salt = lora_name, cache_salt
        return r

    requests = [salted(0), salted(1, cache_salt="u"), salted(2, "x"), salted(3)]
    assert prefix_hit_bound(requests, block_size=16).cached_tokens == [0, 0, 0, 48]


def test_bound_reuses_replies_of_earlier_turns() -> None:
    # SESSIONS (see test_sessions_with_system_prompts_by_hand) at KV block 16 = hash block:
    # r0 writes 60 + 20 - 1 = 79 tokens: 4 blocks (ids 0 1 4 5). r2 shares the system
    # prompt: 2 blocks = 32. Each turn 2 (90 tokens, at most 5 blocks) finds its session's
    # 4 written blocks (prompt and the start of the reply): 64.
    bound = prefix_hit_bound(load_trace(SESSIONS, ROOT), block_size=16)
    assert bound.cached_tokens == [0, 0, 32, 64, 64, 64]
    assert bound.hit_rate == 224 / (3 * 60 + 3 * 90)


def test_bound_refuses_a_kv_block_that_straddles_hash_blocks() -> None:
    with pytest.raises(ValueError, match="hash_block_size 32 is not a multiple of block_size 48"):
        prefix_hit_bound([req(0, 50, 1, [1, 2])], block_size=48)


def test_bound_on_the_mooncake_trace_matches_a_brute_force_count() -> None:
    # At KV block = hash block = 512, a block is cached iff its whole id prefix was written
    # by an earlier request (written: the full 512-token blocks of prompt + output - 1).
    requests = load_trace({"format": "mooncake", "path": MOONCAKE, "limit": 1500}, ROOT)
    seen: set[tuple[int, ...]] = set()
    expected = []
    for r in requests:
        limit = (r.prompt_len - 1) // 512
        hits = 0
        while hits < limit and tuple(r.hash_ids[: hits + 1]) in seen:
            hits += 1
        expected.append(512 * hits)
        written = min(r.prompt_len + r.output_len - 1, 512 * len(r.hash_ids)) // 512
        seen.update(tuple(r.hash_ids[: j + 1]) for j in range(written))
    bound = prefix_hit_bound(requests, block_size=512)
    assert bound.cached_tokens == expected and sum(expected) > 0
    # at KV block 16 every 512-token hit is 32 KV blocks, plus parts of the blocks the
    # 512-granularity count leaves out (never fewer tokens)
    fine = prefix_hit_bound(requests, block_size=16)
    assert all(f >= c for f, c in zip(fine.cached_tokens, expected, strict=True))


def test_prefix_bound_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text(
        "trace:\n"
        "  format: synthetic\n  num_requests: 3\n  arrival: {rate: .inf}\n"
        "  prompt_len: 20\n  output_len: 20\n  hash_block_size: 16\n"
        "  prefix: {prefix_len: 40, num_prefixes: 2, assign: round_robin, num_turns: 2,\n"
        "           think_time_s: 5.0, user_len: 10, output_len: 8}\n"
    )
    assert cli_main(["prefix-bound", str(exp)]) == 0
    assert capsys.readouterr().out == (
        "exp: 6 requests (6 with hash ids), 450 prompt tokens; with an infinite prefix cache "
        "at KV block size 16: 224 cached, hit rate 0.4978\n"
    )
    # The config's max_model_len applies unless --max-model-len is given: first turns are
    # 60 + 20 = 80 tokens, second turns 90 + 8 = 98, so a limit of 85 keeps the first turns
    # alone; the third (prefix 0 again, round robin) reuses the prefix's 2 full blocks of 16.
    exp.write_text(exp.read_text() + "scheduler: {max_model_len: 85}\n")
    assert cli_main(["prefix-bound", str(exp)]) == 0
    assert capsys.readouterr().out == (
        "exp: 3 requests (3 with hash ids), 180 prompt tokens; with an infinite prefix cache "
        "at KV block size 16: 32 cached, hit rate 0.1778\n"
    )
    assert cli_main(["prefix-bound", str(exp), "--max-model-len", "100000"]) == 0
    assert capsys.readouterr().out.startswith("exp: 6 requests")
    assert cli_main(["prefix-bound", str(exp), "--limit", "0"]) == 2
    assert capsys.readouterr().err == f"error: {exp}: --limit: expected an integer >= 1, got 0\n"


def test_prefix_bound_command_with_classes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Workload classes are merged as a run replays them: the prefix class of the test above
    (6 requests, 450 prompt tokens, 224 cached) beside 2 requests of 20 tokens without hash
    ids: 224 / (450 + 40) = 0.4571."""
    prefix = (
        "{prefix_len: 40, num_prefixes: 2, assign: round_robin, num_turns: 2, "
        "think_time_s: 5.0, user_len: 10, output_len: 8}"
    )
    exp = tmp_path / "cls.yaml"
    exp.write_text(
        "trace:\n"
        "  - {name: chat, format: synthetic, num_requests: 3, arrival: {rate: .inf},\n"
        f"     prompt_len: 20, output_len: 20, hash_block_size: 16, prefix: {prefix}}}\n"
        "  - {name: batch, format: synthetic, num_requests: 2, arrival: {rate: .inf},\n"
        "     prompt_len: 20, output_len: 20}\n"
    )
    assert cli_main(["prefix-bound", str(exp)]) == 0
    assert capsys.readouterr().out == (
        "cls: 8 requests (6 with hash ids), 490 prompt tokens; with an infinite prefix cache "
        "at KV block size 16: 224 cached, hit rate 0.4571\n"
    )


def test_readme_bound_figures_are_the_commands() -> None:
    """The hit rates docs/traces.md ("Traces with shared prefixes") quotes, recomputed."""
    import re

    from sched_lab.config import load_config

    text = (ROOT / "docs" / "traces.md").read_text()
    found = re.search(
        r"the first 2,000\s+Mooncake requests of `mooncake.yaml` reach a hit rate of\s+"
        r"(0\.\d{4}) \(([\d,]+) of ([\d,]+) prompt tokens; (0\.\d{4}) for the ([\d,]+) of "
        r"them.*?`--max-model-len 40960`\), the whole trace \(`--limit 12031`\)\s+(0\.\d{4}); "
        r"`synthetic_prefix.yaml` \(([\d,]+) requests from 1,000 conversations\) (0\.\d{4})",
        text,
        re.S,
    )
    assert found, "docs/traces.md figures not found"
    quoted = [float(v) if "." in v else int(v.replace(",", "")) for v in found.groups()]

    def bound(name: str, **keys: Any):
        cfg = load_config(ROOT / "experiments" / name).with_trace(rate_scale=1.0, **keys)
        return load_trace({"seed": cfg.seed, **cfg.trace.spec}, cfg.base_dir), cfg

    mooncake, cfg = bound("mooncake.yaml")
    first = prefix_hit_bound(mooncake, cfg.kv_cache.block_size)
    capped = prefix_hit_bound(mooncake, cfg.kv_cache.block_size, max_model_len=40960)
    whole = prefix_hit_bound(bound("mooncake.yaml", limit=12031)[0], 16)
    synthetic = prefix_hit_bound(bound("synthetic_prefix.yaml")[0], 16)
    assert quoted == [
        round(first.hit_rate, 4),
        first.total_cached_tokens,
        first.prompt_tokens,
        round(capped.hit_rate, 4),
        len(capped.request_ids),
        round(whole.hit_rate, 4),
        len(synthetic.request_ids),
        round(synthetic.hit_rate, 4),
    ]


def test_bound_keys_a_mooncake_partial_block_as_prompt_only():
    """ceil(prompt / 512) ids describe the prompt only (the block manager's rule): request 0
    (1,000 tokens, ids [0, 1]) keys floor(1,000 / 16) = 62 blocks, not the 63 that its
    prompt + output - 1 = 1,019 tokens fill; request 1 (ids [0, 1, 2]) finds those 62."""
    a = Request("0", 0.0, 1000, 20, hash_ids=[0, 1], hash_block_size=512)
    b = Request("1", 20.0, 1100, 20, hash_ids=[0, 1, 2], hash_block_size=512)
    bound = prefix_hit_bound([a, b], block_size=16)
    assert bound.cached_tokens == [0, 62 * 16]
