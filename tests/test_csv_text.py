"""lab/report/csv_text.py: the bytes pandas' to_csv writes, made column-wise."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sched_lab.report import csv_text


def _pandas(df: pd.DataFrame, style: str = "repr") -> bytes:
    fmt = None if style == "repr" else style
    return df.to_csv(index=False, float_format=fmt).encode()


def test_hand_written_cells():
    """repr and %.9g of chosen values, as Python writes them (NaN empty: "" as a row's only
    field, as the csv module writes it)."""
    x = np.array([0.1, 2.0, 1234.5, 1e-4, 1e-5, 1e16, -0.5, np.nan, 0.0, -0.0, 1 / 3])
    df = pd.DataFrame({"x": x})
    assert csv_text.frame_csv(df) == (
        b'x\n0.1\n2.0\n1234.5\n0.0001\n1e-05\n1e+16\n-0.5\n""\n0.0\n-0.0\n0.3333333333333333\n'
    )
    assert csv_text.frame_csv(df, "%.9g") == (
        b'x\n0.1\n2\n1234.5\n0.0001\n1e-05\n1e+16\n-0.5\n""\n0\n-0\n0.333333333\n'
    )


def test_decimal_point_placed_per_row():
    """The point after 1 to 9 digits in the same column, zeros after "0.", a rounding that
    leaves no fraction (zeros before where the point would be), and integers of a column
    wide enough to be looked up from a table of 0..max."""
    x = np.array([0.000123456789, 1.5, 12.25, 123456.789, 98765432.1, 123456789.7, -0.03125])
    df = pd.DataFrame({"x": x})
    assert csv_text.frame_csv(df, "%.9g") == (
        b"x\n0.000123456789\n1.5\n12.25\n123456.789\n98765432.1\n123456790\n-0.03125\n"
    )
    assert csv_text.frame_csv(df) == (
        b"x\n0.000123456789\n1.5\n12.25\n123456.789\n98765432.1\n123456789.7\n-0.03125\n"
    )
    counts = np.array([0, 7, 1000, 1001, 1200] * 1000 + [999, 1100] * 2)  # max < rows / 4
    cells = csv_text.int_cells(counts)
    assert csv_text.pack([cells]) == "".join(f"{v}\n" for v in counts).encode()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("style", ["repr", "%.9g"])
def test_floats_match_pandas(seed, style):
    """Random magnitudes, sums of durations (17-digit reprs), integers, boundaries of the
    fixed-point ranges and of rounding: every byte as pandas writes it."""
    rng = np.random.default_rng(seed)
    n = 20_000
    x = np.concatenate(
        [
            rng.random(n) * 10.0 ** rng.integers(-7, 18, n),
            rng.integers(0, 10**6, n) / rng.choice([1, 2, 4, 8, 10, 100, 1000], n),
            np.cumsum(rng.random(n) * 0.01),
            -rng.random(n) * 1000,
            np.float64(rng.integers(0, 2**53, 1000)),
            [0.5, 2.0**-20, 2.0**40, 1e9, 999999999.5, 123456789.5, 9.9999999995, 0.30000000000000004],
            [5e-324, 1.7976931348623157e308, np.inf, -np.inf, 9.999999999999999e15, 99999.99999999999],
        ]
    )  # fmt: skip
    df = pd.DataFrame({"x": x})
    assert csv_text.frame_csv(df, style) == _pandas(df, style)


def test_other_columns_match_pandas():
    """Integers (int64 edges, small ones, one value throughout), booleans, text that needs
    quoting, nullable integers."""
    rng = np.random.default_rng(2)
    n = 5_000
    i = np.concatenate(
        [rng.integers(-(10**18), 10**18, n), [0, -1, 9, 10, 999, 1000, -(2**63), 2**63 - 1]]
    )
    texts = ["a", "b,c", 'q"x', "", None, "é", "line\nbreak", "cr\rx", "x" * 40]
    df = pd.DataFrame(
        {
            "i": i,
            "b": rng.random(len(i)) > 0.5,
            "s": rng.choice(np.array(texts, dtype=object), len(i)),
            "n": pd.array(rng.choice(np.array([1, None, -5], dtype=object), len(i)), dtype="Int64"),
            "small": rng.integers(0, 7, len(i)),
            "same": np.full(len(i), -12),
        }
    )
    assert csv_text.frame_csv(df) == _pandas(df)
    assert csv_text.frame_csv(df[["s"]]) == _pandas(df[["s"]])  # a lone empty field is ""


def test_string_dtype_columns_are_written_as_stored():
    """A pandas string column (pyarrow or python storage) is factorized as it is, missing
    values empty and text quoted, as pandas writes it."""
    import importlib.util

    storages = ["python"] + (["pyarrow"] if importlib.util.find_spec("pyarrow") else [])
    for storage in storages:
        s = pd.array(["fcfs", None, "a,b", "fcfs", 'q"x'], dtype=pd.StringDtype(storage))
        df = pd.DataFrame({"p": s, "k": [1, 2, 3, 4, 5]})
        assert csv_text.frame_csv(df) == b'p,k\nfcfs,1\n,2\n"a,b",3\nfcfs,4\n"q""x",5\n'
        assert csv_text.frame_csv(df) == _pandas(df)


def test_a_type_it_lacks_is_left_to_pandas():
    df = pd.DataFrame({"t": pd.to_datetime(["2026-01-01"])})
    assert csv_text.frame_csv(df) is None
    with pytest.raises(ValueError, match="float style"):
        csv_text.float_cells(np.array([1.5]), "%.3f")


def test_nullable_integers_of_one_value_with_missing_cells():
    """A nullable Int64 column whose values are all one number (or all missing) is written
    as pandas writes it: the number, and nothing for <NA> (a cluster of one replica writes
    such columns)."""
    df = pd.DataFrame({
        "a": pd.array([0, None, 0], dtype="Int64"),
        "b": pd.array([None, None, None], dtype="Int64"),
        "c": pd.array([7, 7, 7], dtype="Int64"),
    })  # fmt: skip
    assert csv_text.frame_csv(df) == b"a,b,c\n0,,7\n,,7\n0,,7\n" == _pandas(df)


def test_write_csv_in_parts_writes_the_whole_frames_bytes(tmp_path):
    """folder.write_csv makes ``rows`` rows at a time: the file is to_csv's of the whole
    frame, for parts that split a column of one value from rows where it differs, for a
    part pandas writes (a datetime column), and for an empty frame (its header alone)."""
    from sched_lab.report.folder import write_csv

    df = pd.DataFrame({
        "f": [0.1, 2.0, np.nan, 1 / 3, 1e16, -0.5, 7.0, 1e-5, 3.0, 0.25],
        "s": ["a", "b,c", 'q"x', "", None, "x", "y", "z", "w", "v"],
        "n": pd.array([5, 5, 5, None, None, None, 1, 2, 3, 4], dtype="Int64"),
        "i": np.arange(10) * 1000,
    })  # fmt: skip
    for frame, fmt in ((df, None), (df, "%.9g"), (df.assign(t=pd.Timestamp("2026-01-01")), None)):
        path = tmp_path / "x.csv"
        write_csv(path, frame, fmt, rows=3)
        assert path.read_bytes() == frame.to_csv(index=False, float_format=fmt).encode()
    write_csv(tmp_path / "e.csv", df.iloc[:0], rows=3)
    assert (tmp_path / "e.csv").read_bytes() == b"f,s,n,i\n"
