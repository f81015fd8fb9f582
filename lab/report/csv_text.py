"""CSV text of a table built a column at a time with numpy: the bytes pandas' ``to_csv``
writes (``index=False``, the default dialect), without formatting each value in Python.

A column becomes *cells*: a ``(rows, width)`` uint8 matrix of each row's characters, NUL
bytes being padding wherever they sit (no cell holds a NUL of its own), and the length of
each cell; :func:`pack` puts the columns' cells side by side with commas and line ends and
drops the padding. Numbers are turned into text with array arithmetic:

* integers as ``str(int)``;
* floats as ``repr(float)`` (pandas' default: the shortest text that reads back as the same
  float) or as ``"%.9g" % x``. The decimal digits come from the float's exact value times a
  power of ten, held as a sum of two floats (Dekker's exact product), so every rounding is
  the exact one; whole numbers go the integers' way. A value too close to a rounding
  boundary to decide that way, outside the fixed-point range (below 1e-4, from 1e16 for
  ``repr`` or 1e9 for ``%.9g``), a power of two or not finite is formatted by Python;
* text quoted as the ``csv`` module quotes (a comma, quote or line break inside); missing
  values empty.

:func:`column_cells` and :func:`frame_csv` return None for a column type they do not know
(the caller then lets pandas write the table).
"""

from __future__ import annotations

import csv
import io
import os
import re

import numpy as np
import pandas as pd

LINE_END = os.linesep.encode()  # pandas' default lineterminator
_SPECIAL = re.compile('[,"\r\n]')  # a text with one of these is quoted (_quoted)
_POW10 = 10 ** np.arange(19, dtype=np.int64)  # 10**0 .. 10**18
_SPLIT = 134217729.0  # 2**27 + 1: Veltkamp's split of a double into two 26-bit halves
_REPR_DIGITS = 17  # digits that always read back as the same double
_MARGIN = 1e-6  # scaled units: a round trip this close to the interval's edge is decided by Python
_ROWS = 1 << 16  # rows made at a time (bounds the temporary arrays)
Cells = tuple[np.ndarray, np.ndarray]  # (uint8 matrix rows x width, int64 lengths)


# ---------------------------------------------------------------------------- numbers
def _exact_scaled(x: np.ndarray, e10: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x * 10**(16 - e10)`` exactly, as (integer part int64, fraction in [0, 1) float).

    ``x`` is positive and ``16 - e10`` in [0, 22] (``10**s`` is then an exact double, and the
    product is hi + lo exactly by Dekker's two-product)."""
    hi, lo = _two_product(x, 10.0 ** (16 - e10).astype(np.float64))
    floor = np.floor(lo)
    return hi.astype(np.int64) + floor.astype(np.int64), lo - floor


def _two_product(x: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) with hi = fl(x * b) and hi + lo = x * b exactly (Dekker; no overflow)."""
    hi = x * b
    xc = _SPLIT * x
    xh = xc - (xc - x)
    xl = x - xh
    bc = _SPLIT * b
    bh = bc - (bc - b)
    bl = b - bh
    return hi, ((xh * bh - hi) + xh * bl + xl * bh) + xl * bl


def _scaled(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e10, integer part, fraction) with ``x * 10**(16 - e10)`` in [10**16, 10**17): the
    value's 17 leading digits and the exact rest. ``x`` positive, in [1e-5, 1e17)."""
    e10 = np.floor(np.log10(x)).astype(np.int64)
    for _ in range(2):  # log10 may be one off near a power of ten
        whole, frac = _exact_scaled(x, e10)
        e10 = e10 + (whole >= _POW10[17]) - (whole < _POW10[16])
    whole, frac = _exact_scaled(x, e10)
    return e10, whole, frac


def _round(whole: np.ndarray, frac: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``whole + frac`` rounded to a multiple of 10**k, half to even, divided by 10**k;
    whether a tie decided it). ``k`` in [0, 16]."""
    t = _POW10[k]
    digits, rest = np.divmod(whole, t)
    twice = 2 * rest
    up = (twice > t) | ((twice == t) & (frac > 0)) | ((twice == t - 1) & (frac > 0.5))
    tie = ((twice == t) & (frac == 0)) | ((twice == t - 1) & (frac == 0.5))
    up |= tie & (digits % 2 == 1)
    return digits + up, tie


def _shortest(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """repr's digits of positive ``x`` (in [1e-4, 1e16), not a power of two): (digits int64,
    their count, decimal exponent of the first, undecided mask: leave those to Python).

    The shortest digit string that reads back as ``x``, the nearest one among those: the
    nearest p-digit number is tried for p by bisection (if p digits read back, so do p + 1)."""
    e10, whole, frac = _scaled(x)
    # half the gap to the next double, in the scaled units (exact: 5**s * 2**m)
    half_ulp = np.spacing(x) * 10.0 ** (16 - e10).astype(np.float64) / 2
    n = len(x)
    lo = np.ones(n, dtype=np.int64)  # p for which the answer is >= lo
    hi = np.full(n, _REPR_DIGITS, dtype=np.int64)  # known to read back (or undecided)
    unsure = np.zeros(n, dtype=bool)
    while True:
        todo = lo < hi
        if not todo.any():
            break
        mid = (lo + hi) // 2
        k = _REPR_DIGITS - mid
        digits, tie = _round(whole, frac, k)
        gap = (digits * _POW10[k] - whole).astype(np.float64) - frac  # candidate - x
        dist = np.abs(gap)
        unsure |= todo & (tie | (np.abs(dist - half_ulp) < _MARGIN))
        ok = dist < half_ulp
        hi = np.where(todo & ok, mid, hi)
        lo = np.where(todo & ~ok, mid + 1, lo)
    k = _REPR_DIGITS - hi
    digits, tie = _round(whole, frac, k)
    unsure |= tie
    carry = digits == _POW10[hi]  # 9.99... rounded up to 10.0
    digits = np.where(carry, 1, digits)
    count = np.where(carry, 1, hi)
    e10 = e10 + carry
    count, digits = _strip_zeros(digits, count)
    return digits, count, e10, unsure


def _fixed_g(x: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``%.{p}g``'s digits of positive ``x`` in [1e-4, 10**p), as :func:`_shortest` returns
    them. With p <= 15 digits, ``x * 10**(p - 1 - e10)`` is below 2**53: its integer part
    is exact in a float and the rest is the fraction of hi plus lo."""
    e10 = np.floor(np.log10(x)).astype(np.int64)
    top = float(10**p)
    for _ in range(2):  # log10 may be one off near a power of ten
        scale = 10.0 ** (p - 1 - e10).astype(np.float64)
        hi = x * scale
        over, under = hi > top, hi < top / 10
        edge = np.flatnonzero((hi == top) | (hi == top / 10))  # the rest hi + lo decides
        if len(edge):
            lo = _two_product(x[edge], scale[edge])[1]
            over[edge] = (hi[edge] == top) & (lo >= 0)
            under[edge] = (hi[edge] == top / 10) & (lo < 0)
        e10 = e10 + over - under
    hi, lo = _two_product(x, 10.0 ** (p - 1 - e10).astype(np.float64))
    whole = np.floor(hi)
    frac = (hi - whole) + lo  # within 1e-20 of the exact fraction
    below = frac < 0
    whole, frac = whole - below, frac + below
    above = frac >= 1
    whole, frac = whole + above, frac - above
    unsure = np.abs(frac - 0.5) < 1e-9  # a tie, or too close to one to tell
    digits = (whole + (frac > 0.5)).astype(np.int64)
    carry = digits == 10**p
    digits = np.where(carry, 10 ** (p - 1), digits)
    e10 = e10 + carry
    count, digits = _strip_zeros(digits, np.full(len(x), p, dtype=np.int64))
    return digits, count, e10, unsure


def _strip_zeros(digits: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop trailing zero digits (keeping one digit). Each pass reads only the values the
    pass before shortened."""
    digits, count = digits.copy(), count.copy()
    at = np.flatnonzero((digits % 10 == 0) & (count > 1))
    while len(at):
        digits[at] //= 10
        count[at] -= 1
        at = at[(digits[at] % 10 == 0) & (count[at] > 1)]
    return count, digits


def _groups(values: np.ndarray, g: int) -> list[np.ndarray]:
    """The ``g`` groups of 3 decimal digits of each of ``values`` (non-negative int64 below
    10**(3g)), most significant first: one int64 array per group. Below 10**9 float
    arithmetic is exact and faster than int64 division."""
    if g > 3:  # two halves of 9 digits
        high, low = np.divmod(values, 10**9)
        return _groups(high, g - 3) + _groups(low, 3)
    v = values.astype(np.float64)
    out = []
    for _ in range(g - 1):
        top = np.floor(v / 1000.0)
        out.append((v - top * 1000.0).astype(np.int64))
        v = top
    out.append(v.astype(np.int64))
    return out[::-1]


def _group_words(groups: list[np.ndarray], offsets: list | None = None) -> np.ndarray:
    """Cells of ``groups`` (:func:`_groups`) side by side, 4 bytes each: zero-padded, or
    group k as the table row ``offsets[k]`` past its value (see :func:`_group_table`)."""
    words = np.empty((len(groups[0]), len(groups)), dtype=np.uint32)
    for k, group in enumerate(groups):
        words[:, k] = _GROUPS[group if offsets is None else group + offsets[k]]
    return words.view(np.uint8).reshape(len(groups[0]), 4 * len(groups))


def _group_table() -> np.ndarray:
    """Cells of a group of 3 digits as uint32 (3 characters and a NUL, so a gather moves one
    word): rows 0-999 zero-padded; 1000 + i ``str(i)``; 2000 + i empty. Shorter texts are
    NUL-padded."""
    texts = [f"{i:03d}" for i in range(1000)] + [str(i) for i in range(1000)] + [""] * 1000
    table = np.zeros((len(texts), 4), dtype=np.uint8)
    for row, t in zip(table, texts):
        row[3 - len(t) : 3] = list(t.encode())
    return table.view(np.uint32).ravel()


_GROUPS = _group_table()


def _layout(digits: np.ndarray, count: np.ndarray, point: np.ndarray, point_zero: bool) -> Cells:
    """Cells of the fixed-point text of ``digits`` (``count`` of them, < 10**17) with the
    decimal point after ``point`` (<= 17) digits (<= 0: ``0.`` and zeros first; past the digits:
    zeros, then ``.0`` if ``point_zero``). The digits are written left-aligned from one
    zero-padded string per value, each shown up to its last; the point is put in a slot
    after the digit it follows (NUL in other rows: see :func:`pack`)."""
    n = len(digits)
    if n == 0:
        return np.zeros((0, 0), dtype=np.uint8), np.zeros(0, dtype=np.int64)
    after = point >= count  # no fraction but the ".0" of point_zero
    shown = np.where(after, point + point_zero, count)  # digits shown, zeros past the value
    width = int(shown.max())
    dot = (shown > point) & (point >= 1)  # a point after digit point - 1 (else in the prefix)
    lead = point < 1  # "0." and -point zeros first
    g = -(-width // 3)  # groups of 3 digits: at most 6 (18 digits)
    value = digits * _POW10[3 * g - count]  # the digits left-aligned in 3g places
    text = _group_words(_groups(value, g))  # zero-padded, a NUL after each group
    digit = np.arange(width)
    text = text[:, digit // 3 * 4 + digit % 3]  # the first ``width`` digits
    text[digit[None, :] >= shown[:, None]] = 0
    zeros = int(-point.min()) if lead.any() else -2  # zeros after "0."; -2: no prefix
    prefix = 2 + zeros
    dots = np.flatnonzero(np.bincount(point[dot], minlength=width + 1))  # points in use
    out = np.zeros((n, prefix + width + len(dots)), dtype=np.uint8)
    col = prefix + digit + np.searchsorted(dots, digit, side="right")  # after their dots
    out[:, col] = text
    if prefix:
        out[:, 0] = np.where(lead, np.uint8(ord("0")), np.uint8(0))
        out[:, 1] = np.where(lead, np.uint8(ord(".")), np.uint8(0))
        for k in range(zeros):
            out[:, 2 + k] = np.where(point < -k, np.uint8(ord("0")), np.uint8(0))
    for p in dots:  # the slot right after digit p - 1
        out[:, col[p - 1] + 1] = np.where(dot & (point == p), np.uint8(ord(".")), np.uint8(0))
    length = shown + dot + np.where(lead, 2 - point, 0)
    return out, length.astype(np.int64)


def _right_aligned(values: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Each of ``values`` (< 10**18) right-aligned with NUL before it, in 4 bytes per group
    of 3 digits: ``str(value)``, ``width`` its length."""
    n, g = len(values), -(-int(width.max(initial=0)) // 3)
    if n == 0 or g == 0:
        return np.zeros((n, 0), dtype=np.uint8)
    if g == 1:  # below 1,000: one lookup each, as narrow as the widest
        most = int(width.max())
        return _GROUPS[values + 1000].view(np.uint8).reshape(n, 4)[:, 3 - most : 3]
    # Group k by the value's length: empty before its first digit, the first group shown
    # without leading zeros, zero-padded after.
    digits = np.arange(19)  # a value's length, 0 to 18
    offsets = []
    for k in range(g):
        after = 3 * (g - k - 1)  # digits after group k
        offsets.append(
            np.where(digits <= after, 2000, np.where(digits <= after + 3, 1000, 0))[width]
        )
    return _group_words(_groups(values, g), offsets)


def float_cells(x: np.ndarray, style: str = "repr") -> Cells:
    """Cells of a float64 column as pandas writes it: ``repr`` (no float_format) or
    ``"%.<p>g"`` (p <= 15) as its float_format; NaN empty."""
    x = np.asarray(x, dtype=np.float64)
    g = None if style == "repr" else _precision(style)
    n = len(x)
    a = np.abs(x)
    top = 1e16 if g is None else 10.0**g
    with np.errstate(invalid="ignore"):
        whole = (a == np.floor(a)) & (a < top)  # integral: as an integer (+ ".0" for repr)
        mant = a.view(np.int64) & ((1 << 52) - 1)
        fast = np.isfinite(a) & (a >= 1e-4) & (a < top) & (mant != 0) & ~whole
    parts = []
    iw = np.flatnonzero(whole)
    if len(iw):
        cells, length = int_cells(x[iw].astype(np.int64))
        if g is None:
            cells = np.concatenate([cells, np.broadcast_to(np.frombuffer(b".0", np.uint8),
                                                            (len(iw), 2))], axis=1)  # fmt: skip
            length = length + 2
        negative_zero = np.signbit(x[iw]) & (x[iw] == 0)
        if negative_zero.any():  # "-0.0" / "-0"
            cells, length = _signed(cells, length, negative_zero)
        parts.append((iw, (cells, length)))
    idx = np.flatnonzero(fast)
    if g is None:
        digits, count, e10, unsure = _shortest(a[idx])
        ok = ~unsure & (e10 >= -4) & (e10 <= 15)
    else:
        digits, count, e10, unsure = _fixed_g(a[idx], g)
        ok = ~unsure & (e10 >= -4) & (e10 < g)
    cells, length = _layout(digits[ok], count[ok], e10[ok] + 1, g is None)
    sign = x[idx[ok]] < 0
    if sign.any():
        cells, length = _signed(cells, length, sign)
    parts.append((idx[ok], (cells, length)))
    done = np.zeros(n, dtype=bool)
    for where, _ in parts:
        done[where] = True
    rest = np.flatnonzero(~done)
    fmt = repr if g is None else style.__mod__
    texts = ["" if v != v else fmt(v) for v in x[rest].tolist()]  # NaN: empty (na_rep)
    parts.append((rest, text_cells(texts, quote=False)))
    return _merge(n, parts)


def _precision(style: str) -> int:
    """p of a ``"%.<p>g"`` float format; ValueError for any other."""
    p = style[2:-1]
    if not (style.startswith("%.") and style.endswith("g") and p.isdigit() and 1 <= int(p) <= 15):
        raise ValueError(f"float style: expected 'repr' or '%.<p>g' with p in 1..15, got {style!r}")
    return int(p)


def int_cells(v: np.ndarray) -> Cells:
    """Cells of an integer column: ``str(int)``."""
    v = np.asarray(v)
    big = np.zeros(len(v), dtype=bool)
    if len(v) and (v.max() >= _POW10[18] or (v.dtype.kind == "i" and v.min() <= -_POW10[18])):
        big = (v >= _POW10[18]) | ((v <= -_POW10[18]) if v.dtype.kind == "i" else False)
    if len(v) and not big.any() and v.min() == v.max():  # one value: format it once
        one, length = text_cells([str(int(v[0]))])
        return np.broadcast_to(one, (len(v), one.shape[1])), np.repeat(length, len(v))
    keep = np.flatnonzero(~big)
    a = v[keep].astype(np.int64)
    if len(a) and 0 <= a.min() and 1000 <= a.max() < len(a) // 4:  # 0..max made, looked up
        cells, length = _digit_cells(np.arange(a.max() + 1))
        cells, length = cells[a], length[a]
    else:
        negative = a < 0
        cells, length = _digit_cells(np.abs(a))
        if negative.any():
            cells, length = _signed(cells, length, negative)
    if not big.any():
        return cells, length
    rest = np.flatnonzero(big)
    texts = text_cells([str(i) for i in v[rest].tolist()])
    return _merge(len(v), [(keep, (cells, length)), (rest, texts)])


def _digit_cells(a: np.ndarray) -> Cells:
    """Cells of non-negative int64 values below 10**18: ``str(int)``."""
    count = np.ones(len(a), dtype=np.int64)
    for k in range(1, len(str(int(a.max(initial=0))))):
        count += a >= _POW10[k]
    return _right_aligned(a, count), count


def _signed(cells: np.ndarray, length: np.ndarray, negative: np.ndarray) -> Cells:
    """``-`` before the cells of the ``negative`` rows."""
    sign = np.where(negative, np.uint8(ord("-")), np.uint8(0))[:, None]
    return np.concatenate([sign, cells], axis=1), length + negative


def _merge(n: int, parts: list[tuple[np.ndarray, Cells]]) -> Cells:
    """Cells of ``n`` rows from ``parts``: (rows, their cells) pairs."""
    width = max(cells.shape[1] for _, (cells, _) in parts)
    out = np.zeros((n, width), dtype=np.uint8)
    length = np.zeros(n, dtype=np.int64)
    for where, (cells, lens) in parts:
        out[where, width - cells.shape[1] :] = cells
        length[where] = lens
    return out, length


def text_cells(texts: list[str], quote: bool = True) -> Cells:
    """Cells of strings (UTF-8, left-aligned), quoted as the csv module quotes them
    (QUOTE_MINIMAL)."""
    if quote and _SPECIAL.search("".join(texts)):  # (one scan: most columns need none)
        texts = [_quoted(t) for t in texts]
    data = [t.encode() for t in texts]
    length = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
    width = int(length.max(initial=0))
    if width == 0:
        return np.zeros((len(data), 0), dtype=np.uint8), length
    cells = np.frombuffer(np.array(data, dtype=f"S{width}").tobytes(), dtype=np.uint8)
    return cells.reshape(len(data), width), length


def _quoted(t: str) -> str:
    """``t`` as the csv module writes it in a row of several fields."""
    if not _SPECIAL.search(t):
        return t
    buf = io.StringIO()  # the module decides (its rules for \r differ between versions)
    csv.writer(buf, lineterminator="\n").writerow([t, ""])
    return buf.getvalue()[:-2]  # less the empty last field's "," and the line end


def constant_cells(text: str, n: int) -> Cells:
    """``n`` cells of the same text (already formatted)."""
    one, length = text_cells([text])
    return np.broadcast_to(one, (n, one.shape[1])), np.full(n, length[0], dtype=np.int64)


# ---------------------------------------------------------------------------- tables
def column_cells(col: pd.Series | np.ndarray, float_style: str = "repr") -> Cells | None:
    """Cells of one column as ``to_csv`` writes it; None for a type not handled here."""
    dtype = col.dtype
    if isinstance(col, pd.Series) and not isinstance(dtype, np.dtype):
        if pd.api.types.is_integer_dtype(dtype):  # nullable Int64: <NA> empty
            na = col.isna().to_numpy()
            cells, length = int_cells(col.fillna(0).to_numpy(np.int64))
            if na.any():  # (a column of one value comes back as a read-only broadcast)
                cells = cells.copy()
                cells[na] = 0
            return cells, np.where(na, 0, length)
        if pd.api.types.is_string_dtype(dtype):  # factorized as stored: no str object a row
            return _object_cells(col)
        return None
    values = np.asarray(col)
    if dtype.kind in "iu":
        return int_cells(values)
    if dtype == np.float64:
        return float_cells(values, float_style)
    if dtype.kind == "b":
        return text_cells(["True" if v else "False" for v in values.tolist()], quote=False)
    if dtype.kind == "O":
        return _object_cells(values)
    return None


def _object_cells(values: np.ndarray | pd.Series) -> Cells | None:
    """Cells of an object (or string dtype) column: ``str()`` of each value, missing ones
    empty; each distinct value is formatted once. None for a value that is not text or a
    number."""
    codes, uniques = pd.factorize(values, use_na_sentinel=True)  # missing: code -1
    out = []
    for v in uniques.tolist() if hasattr(uniques, "tolist") else list(uniques):
        if not isinstance(v, (str, int, float)) or "\0" in str(v):  # a NUL would be cut
            return None
        out.append("" if isinstance(v, float) and v != v else str(v))  # pandas: str()
    cells, length = text_cells(out + [""])  # the last: missing values
    return cells[codes], length[codes]


def pack(columns: list[Cells], header: list[str] | None = None) -> bytes:
    """The CSV bytes of ``columns`` (each a column's cells, all of one length), with a
    ``header`` line first when given. Cells hold no NUL byte: a row is its cells side by
    side with the separators, less the padding."""
    head = b""
    if header is not None:
        head = b",".join(t.encode() for t in map(_quoted, header)) + LINE_END
    if not columns:
        return head
    n = len(columns[0][1])
    if len(columns) == 1:  # the csv module quotes a row's only field when it is empty
        cells, length = columns[0]
        if (length == 0).any():
            empty = length == 0
            cells = np.pad(cells, ((0, 0), (0, max(2 - cells.shape[1], 0))))
            cells[empty, :2] = ord('"')
            columns = [(cells, np.where(empty, 2, length))]
    parts = [head]
    for a in range(0, n, _ROWS):
        pieces = []
        for i, (cells, _) in enumerate(columns):
            pieces.append(cells[a : a + _ROWS])
            last = i == len(columns) - 1
            sep = np.frombuffer(LINE_END if last else b",", dtype=np.uint8)
            pieces.append(np.broadcast_to(sep, (len(pieces[-1]), len(sep))))
        rows = np.concatenate(pieces, axis=1)
        parts.append(rows.tobytes().translate(None, b"\0"))  # less the padding
    return b"".join(parts)


def frame_csv(df: pd.DataFrame, float_style: str = "repr", header: bool = True) -> bytes | None:
    """``df.to_csv(index=False, header=header)`` (with ``float_format=float_style`` unless
    ``repr``) as bytes; None when a column's type is not handled here."""
    cells = []
    for name in df.columns:
        c = column_cells(df[name], float_style)
        if c is None:
            return None
        cells.append(c)
    return pack(cells, [str(c) for c in df.columns] if header else None)
