"""StepRecorder's narrowing as it records: whole rows every CHUNK_ROWS (patched small here)
into a part of each column, the repeats' integer columns with them; StepColumns reads the
parts as if the columns had been narrowed whole at the end."""

from __future__ import annotations

import numpy as np
import pytest

from sched_lab.sim import records
from sched_lab.sim.records import STEP_COLUMNS, StepRecorder, _Parts

WIDTH = len(STEP_COLUMNS)
SEQS = STEP_COLUMNS.index("num_seqs")
PREFILL = STEP_COLUMNS.index("num_prefill_tokens")


def row(k: int) -> list[float]:
    """Whole row k: column i holds 100 * k + i (time_s k * 100.0, duration_s 100k + 1)."""
    return [float(100 * k + i) for i in range(WIDTH)]


@pytest.fixture
def chunk3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "CHUNK_ROWS", 3)


def test_exactly_chunk_rows_whole_rows_are_narrowed_at_once(chunk3):
    """The 3rd whole row narrows all three (nothing waits as float64); the 4th waits."""
    rec = StepRecorder()
    for k in range(3):
        rec.append(row(k), ["r"])
    assert len(rec._values) == 0
    parts = [[p.dtype.name for p in c] for c in rec._whole[:3]]
    assert parts == [["float64"], ["float64"], ["int16"]]  # 2, 102, 202: int16
    rec.append(row(3), [])
    assert len(rec._values) == WIDTH
    steps, ticks = rec.columns()
    assert ticks.tolist() == [0, 1, 2]
    assert steps["time_s"].tolist() == [0.0, 100.0, 200.0, 300.0]
    assert steps["num_prefill_tokens"].tolist() == [2, 102, 202, 302]
    assert steps["num_prefill_tokens"].dtype == steps.dtype("num_prefill_tokens") == np.int64
    assert [p.dtype.name for p in steps._whole["num_prefill_tokens"]._parts] == ["int16"] * 2
    assert steps["duration_s"].tolist() == [1.0, 101.0, 201.0, 301.0]
    assert steps["duration_s"].dtype == np.float64


def test_repeats_across_a_chunk_boundary(chunk3):
    """Repeats recorded before and after the whole rows are narrowed (their integer columns
    waiting and narrowed with them) read back in step order with their template rows."""
    rec = StepRecorder()
    rec.append(r0 := row(0), ["r"])  # 0
    rec.append_repeats(r0, [1.0, 2.0], [0.5, 0.5], [7, 8], [30, 31], [1, 2])  # 1, 2
    rec.append(row(1), [])  # 3
    rec.append(r2 := row(2), ["r"])  # 4: the third whole row, narrowed with both repeats
    assert len(rec._values) == 0 and len(rec._repeated[2]) == 0
    rec.append_repeat(r2, 5.0, 0.25, 9, 32, 3)  # 5: waits
    rec.append_repeats(r2, [6.0], [0.25], [10], [33], [4])  # 6: waits (1 of 3)
    rec.append(row(3), ["r"])  # 7
    assert rec.num_steps == 8
    steps, ticks = rec.columns()
    assert ticks.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert steps.repeats.tolist() == [False, True, True, False, False, True, True, False]
    assert steps["time_s"].tolist() == [0.0, 1.0, 2.0, 100.0, 200.0, 5.0, 6.0, 300.0]
    assert steps["duration_s"].tolist() == [1.0, 0.5, 0.5, 101.0, 201.0, 0.25, 0.25, 301.0]
    assert steps["kv_used_blocks"].tolist() == [5, 7, 8, 105, 205, 9, 10, 305]
    assert steps["decode_context_tokens"].tolist() == [16, 30, 31, 116, 216, 32, 33, 316]
    assert steps["kv_cached_blocks"].tolist() == [19, 1, 2, 119, 219, 3, 4, 319]
    assert steps["num_waiting"].tolist() == [7, 7, 7, 107, 207, 207, 207, 307]
    assert [p.dtype.name for p in steps._repeated["kv_cached_blocks"]._parts] == ["int8"] * 2
    assert steps.rows(2, 6)["kv_used_blocks"].tolist() == [8, 105, 205, 9]


def test_a_bulk_of_repeats_is_narrowed_when_chunk_rows_of_them_wait(chunk3):
    rec = StepRecorder()
    rec.append(r := row(0), ["r"])
    rec.append_repeats(r, [1.0, 2.0], [0.5] * 2, [7, 8], [30, 31], [1, 2])
    assert len(rec._repeated[2]) == 2  # 2 < 3: waits
    rec.append_repeats(r, [3.0], [0.5], [300], [32], [3])
    assert len(rec._repeated[2]) == 0 and len(rec._values) == WIDTH  # row 0 still waits
    assert [p.tolist() for p in rec._repeat_parts[0]] == [[7, 8, 300]]  # kv_used_blocks
    assert rec._repeat_parts[0][0].dtype == np.int16
    steps, _ = rec.columns()
    assert steps["kv_used_blocks"].tolist() == [5, 7, 8, 300]
    assert steps["time_s"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_later_part_wider_than_an_earlier_one_and_the_other_way(chunk3):
    """num_seqs: part 1 fits int8, part 2 needs int32 (-70,000); num_prefill_tokens: 2**40
    in part 1 (int64), part 2 int16. Read as int64, also across the parts' boundary."""
    rec = StepRecorder()
    rows = [row(k) for k in range(5)]
    for k, r in enumerate(rows):
        r[SEQS] = float(k)
    rows[4][SEQS] = -70_000.0
    rows[1][PREFILL] = 2.0**40
    for r in rows:
        rec.append(r, [])
    steps, _ = rec.columns()
    assert [p.dtype.name for p in steps._whole["num_seqs"]._parts] == ["int8", "int32"]
    assert steps["num_seqs"].tolist() == [0, 1, 2, 3, -70_000]
    assert [p.dtype.name for p in steps._whole["num_prefill_tokens"]._parts] == [
        "int64", "int16"
    ]  # fmt: skip
    assert steps["num_prefill_tokens"].tolist() == [2, 2**40, 202, 302, 402]
    assert steps.rows(2, 4)["num_prefill_tokens"].tolist() == [202, 302]
    assert steps.rows(1, 5)["num_seqs"].tolist() == [1, 2, 3, -70_000]
    assert steps.rows(1, 5)["num_seqs"].dtype == np.int64


def test_parts_are_taken_as_one_array():
    """Parts [1, 2, 3] (int8), [300, 4] (int16), [5] (int8): any range as one array."""
    parts = _Parts("num_seqs", [np.array([1, 2, 3], np.int8), np.array([300, 4], np.int16),
                                np.array([], np.int8), np.array([5], np.int8)])  # fmt: skip
    assert parts.take(2, 5).tolist() == [3, 300, 4] and parts.take(2, 5).dtype == np.int16
    assert parts.take(0, 3).dtype == np.int8 and parts.take(0, 6).tolist() == [1, 2, 3, 300, 4, 5]
    assert parts.take(3, 4).tolist() == [300] and parts.take(5, 6).tolist() == [5]
    assert parts.take(4, 4).tolist() == [] and parts.take(4, 4).dtype == np.int64
    assert _Parts("time_s", []).take(0, 0).dtype == np.float64
    one = np.arange(4.0)
    assert _Parts("time_s", one).take(1, 3).tolist() == [1.0, 2.0]


def test_a_row_that_is_not_numbers_is_refused_and_not_appended(chunk3):
    rec = StepRecorder()
    rec.append(row(0), [])
    bad = row(1)
    bad[4] = "x"
    with pytest.raises(TypeError):
        rec.append(bad, [])
    rec.append(row(2), [])
    assert rec.num_steps == 2
    steps, _ = rec.columns()
    assert steps["num_seqs"].tolist() == [4, 204]


def test_packed_values_are_those_fromlist_appends():
    """Rows and repeats are appended as packed float64 bytes: the same values, to the bit,
    as ``array("d").fromlist`` (ints, floats, bools, numpy scalars, ints up to 2**53); a
    huge int is refused as fromlist refuses it (OverflowError), appending nothing."""
    from array import array

    from sched_lab.sim.records import _packer

    values = [0.1, 1e-300, -0.0, 3, True, np.int64(7), np.float64(2.5), 2**53, -(2**40)]
    expect = array("d")
    expect.fromlist(values)
    assert _packer(len(values))(*values) == expect.tobytes()
    rec = StepRecorder()
    full = row(1)
    full[2], full[3] = 2**53, np.int64(-5)
    rec.append(full, ["r"])
    huge = row(2)
    huge[5] = 2**1100
    with pytest.raises(OverflowError):
        rec.append(huge, [])
    rec.append_repeats(full, [1.5, 2.25], [0.5, 0.75], [7, 8], [30, 31], [0, 1])
    with pytest.raises(OverflowError):
        rec.append_repeats(full, [3.0], [0.5], [2**1100], [32], [0])
    assert rec.num_steps == 4  # (the refused repeat was counted, as before)
    assert rec._repeated[0].tolist() == [1.5, 2.25, 3.0]
    assert rec._repeated[2].tolist() == [7.0, 8.0]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chunked_records_equal_records_narrowed_at_the_end(monkeypatch, chunk):
    """A random recording (whole rows, single and bulk repeats, ranges that need every type,
    LoRA columns) gives the same columns, value and dtype, narrowed in chunks as at the end."""
    rng = np.random.default_rng(7)
    caps = [(3, 6, 12, 20, 40)[i % 5] for i in range(WIDTH + 2)]  # int8 int8 int16 int32 int64
    script = []  # (kind, args): whole rows, then their repeats; values widen with the step
    for step in range(60):
        r = [float(rng.integers(-(2 ** min(step, c)), 2 ** min(step, c))) for c in caps]
        r[0], r[1], r[15] = step * 0.5, 0.125 * step, step / 3  # the float columns
        script.append(("row", r, bool(step % 3)))
        for _ in range(int(rng.integers(0, 3))):
            n = int(rng.integers(1, 4))
            ints = [rng.integers(0, 2 ** min(step, c), n).tolist() for c in (5, 10, 18)]
            script.append(("repeats", [step + 0.25] * n, [0.5] * n, *ints))

    def record(k: int):
        monkeypatch.setattr(records, "CHUNK_ROWS", k)
        rec = StepRecorder(records.LORA_COLUMNS)
        last = None
        for kind, *args in script:
            if kind == "row":
                last = args[0]
                rec.append(last, ["r"] if args[1] else [])
            elif len(args[0]) == 1:
                rec.append_repeat(last, *(a[0] for a in args))
            else:
                rec.append_repeats(last, *args)
        return rec.columns()

    (big, big_ticks), (small, small_ticks) = record(10**6), record(chunk)
    assert small_ticks.tolist() == big_ticks.tolist()
    assert small.repeats.tolist() == big.repeats.tolist()
    assert list(small) == list(big) == [*STEP_COLUMNS, *records.LORA_COLUMNS]
    for c in big:
        assert small[c].dtype == big[c].dtype and small[c].tolist() == big[c].tolist(), c
        for start, stop in [(0, 1), (3, 40), (17, 18), (50, big.num_steps)]:
            assert small.rows(start, stop)[c].tolist() == big[c][start:stop].tolist()
    kept = {big._whole[c]._parts[0].dtype.name for c in big}  # one part each
    assert kept == {"float64", "int8", "int16", "int32", "int64"}
    kept = [big._repeated[c]._parts[0].dtype.name for c in records.REPEAT_COLUMNS[2:]]
    assert kept == ["int8", "int16", "int32"]
    assert len(small._whole["num_seqs"]._parts) == -(-60 // chunk)
