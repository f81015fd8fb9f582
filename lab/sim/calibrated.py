"""A cost model fitted to the real engine's profile (backend/profile.py).

    sched-lab fit h200_qwen3-0.6b      # fit a bundled profile, print the fit and its error

Step time is linear in features of sched_lab.core.plan.StepFeatures:

    t = c0 * [decode-only step]             a CUDA-graph decode step (per batch size)
      + c1 * [step with prompt tokens]      a step that also runs the prefill kernel
      + c2 * sequences                      input preparation and sampling
      + c3 * tokens + c4 * max(0, tokens - TOKEN_KNOT)
                                            linear layers: weight-read, then compute bound
      + c5 * mean decode context            decode attention latency
      + c6 * decode context tokens          KV bytes all decodes read
      + c7 * prefill cached tokens          KV bytes the prompt chunks read
      + c8 * prefill (query, key) pairs     attention work of prompt chunks
      + c9 * swapped KV tokens              host-link bytes (blocks * block_size)
      + c10 * max(0, tokens - EAGER_KNOT)   eager steps, above the largest CUDA graph
      + c11 * swap transfers                one host <-> device copy per run of CPU ids
      + c12 * paged prefill pairs           the pairs the paged Triton kernel computes

Coefficients are >= 0 but c10, whose slope above the knot (c3 + c4 + c10) is kept >= 0; c10
is fitted only with at least ``MIN_EAGER_ROWS`` non-replay rows above ``EAGER_KNOT``, else it
is 0. The fit is least squares on error relative to each row's duration.

Prefill attention runs one of two kernels (backend/attention/flash_varlen.py, ``auto``): an
eager step (above ``EAGER_KNOT`` tokens) whose prompt chunks all start at position 0 and
average at least ``VARLEN_MIN_MEAN_CHUNK`` tokens runs FlashAttention varlen; every other
step (in a CUDA graph, with a chunk over cached tokens: a later chunk, a prefix-cache hit, or
with draft verify rows: :meth:`CalibratedCostModel.spec_step_time`) the paged Triton
kernel. c8 prices a pair on the first, c8 + c12 on the second (the :func:`paged_pairs`
feature: all of a step's pairs or none; a step's features do not tell which of its chunks
have cached tokens, so an eager step with any is counted paged). c12 is fitted only with at
least ``MIN_EAGER_ROWS`` non-replay rows whose pairs run varlen (the grid rows of one to
eight prompts above the knot), else it is 0 and c8 prices every pair. It is best determined
with paged rows above the knot too (the grid's ``prefill_eager_prefix`` rows: eager steps
over a cached prefix); without them c12 comes from the CUDA-graph rows, whose steps have
far fewer pairs, and eager steps over a prefix-cache hit are priced by extrapolation.

Swaps: a KV token is a fixed number of bytes of the profiled model, so c9 is a per-byte
rate and a run at another block size pays for its blocks' bytes (swapped blocks times the
run's ``block_size``; the profile's rows count blocks of the block size its header names,
``block_size N``, 16 if none). c11 is the cost of one transfer (``num_swap_runs``, a run of
consecutive CPU block ids as the engine copies it). A profile without a ``num_swap_runs``
column (those made before it, and engine steps.csv files) leaves the runs unknown: they
read as 0 and c11 is 0, the whole swap cost fitted per byte. (Estimating runs = blocks
instead would make the two swap columns proportional at one block size, so the fit could
not tell latency from bandwidth and would split the cost arbitrarily between them.)

KV dtype (``kv_cache.dtype``): c6, c7 and c9 price KV bytes. A profile made with the KV cache in
the model's dtype (its header names no ``kv_cache_dtype fp8``) fits those bytes; a run with
an FP8 KV cache reads and swaps half as many per token (bf16 -> fp8), so those three
coefficients are scaled by the ratio of KV bytes (:func:`kv_bytes_ratio`). A profile made
with FP8 KV (``sched-lab profile`` on an engine with ``kv_cache.dtype: fp8``) fits its own
bytes and is used as it is by an fp8 run; c5, a latency per context token, is never scaled.

Host time (asynchronous scheduling): a profile with a ``host_s`` column (seconds from a step's
start until it is launched) gets a second fit, on error relative to the step's duration:

    host = h0 * [decode-only step] + h1 * [step with prompt tokens] + h2 * sequences
         + h3 * tokens + h4 * context tokens + h5 * swapped blocks

clipped to [0, step time]; device time = step time - host time. Without ``host_s`` host time
is 0 (asynchronous scheduling then saves nothing).

LoRA (a profile made with ``--lora-dir``, rows with ``num_loras`` > 0; docs/lora.md): the base
fit above uses only the rows without adapters; the rows with adapters then fit what the
adapters add to it, least squares on their residual relative to each row's duration,
coefficients >= 0:

    t_lora = l0 * [step with an adapter] + l1 * distinct adapters + l2 * LoRA tokens

added to a step only when its ``num_loras`` > 0. Every row of such a profile ran with the
adapters attached (``# lora:`` header line, with their rank), so the base rows price a step of
a LoRA-enabled engine whose batch has no adapter. A profile without such rows prices no LoRA
compute (:data:`NO_LORA_NOTE`); adapter loads are priced from the link in both cases
(``lora_load_s``, set by the simulator's setup). Engine steps.csv rows with adapters
(``replay_steps``) are left out of the fit: steps.csv has no ``num_lora_tokens``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from importlib.resources import files
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd

from sched_lab.core.errors import ConfigError, OneLineParser, did_you_mean
from sched_lab.core.fingerprint import HEADER_PREFIX, differences
from sched_lab.core.kv_dtypes import kv_dtype_bytes
from sched_lab.core.plan import StepFeatures
from sched_lab.sim.noise import (
    KINDS,
    MIN_ROWS,
    StepNoise,
    fit_spells,
    fit_to_profile,
    step_kind,
)

TOKEN_KNOT = 2048
# backend/cuda_graphs.py's largest default token size (DEFAULT_TOKEN_SIZES[-1]; a test ties
# the two): a larger step runs eagerly. sched_lab.sim does not import backend.
EAGER_KNOT = 8192
MIN_EAGER_ROWS = 3  # profile rows above EAGER_KNOT needed to fit its slope (else it is 0)
# backend/attention/flash_varlen.py's VARLEN_MIN_MEAN_CHUNK (a test ties the two): an eager
# step's chunks from position 0 run FlashAttention varlen when they average at least this.
VARLEN_MIN_MEAN_CHUNK = 1024
REPLAY_KIND = "replay"  # the kind of a replay step's row (steps_as_profile)
FEATURES = ("decode_only_step", "prefill_step", "num_seqs", "num_tokens",
            f"tokens_over_{TOKEN_KNOT}", "mean_decode_context", "decode_context_tokens",
            "prefill_context_tokens", "prefill_attention_pairs", "num_swap_tokens",
            f"tokens_over_{EAGER_KNOT}", "num_swap_runs", "paged_prefill_pairs")  # fmt: skip
_TOKENS, _HINGE, _PAIRS, _EAGER, _RUNS, _PAGED = 3, 4, 8, 10, 11, 12  # columns of FEATURES
DEFAULT_BLOCK_SIZE = 16  # a profile's block size when its header names none (profile.py's)
RUNS_COLUMN = "num_swap_runs"  # optional profile column (module doc: unknown reads as 0)
PROFILE_COLUMNS = ("num_prefill_tokens", "num_prefills", "prefill_context_tokens",
                   "prefill_attention_pairs", "num_decodes", "decode_context_tokens",
                   "num_swap_blocks", "duration_s")  # fmt: skip
HOST_FEATURES = ("decode_only_step", "prefill_step", "num_seqs", "num_tokens",
                 "context_tokens", "num_swap_blocks")  # fmt: skip
SPEC_COLUMNS = ("num_spec_tokens", "num_spec_decodes", "spec_context_tokens")  # StepFeatures'
HOST_COLUMN = "host_s"  # optional profile column: host seconds until the step is launched
NO_HOST_NOTE = (
    "the profile has no host_s column (made before host times were recorded): host time "
    "is 0, so asynchronous scheduling is predicted to save nothing"
)
# Columns of a steps.csv that replay_steps reads (steps_as_profile renames and sums them).
STEPS_COLUMNS = ("num_prefill_tokens", "num_prefills", "prefill_context_tokens",
                 "prefill_attention_pairs", "num_decode_tokens", "decode_context_tokens",
                 "num_swap_out_blocks", "num_swap_in_blocks", "duration_s")  # fmt: skip
LORA_COLUMNS = ("num_loras", "num_lora_tokens")  # optional profile columns (StepFeatures')
LORA_FEATURES = ("lora_step", "num_loras", "num_lora_tokens")  # module doc: l0, l1, l2
NO_LORA_NOTE = (
    "the profile has no rows with LoRA adapters (made without --lora-dir): LoRA compute is "
    "not modelled, only adapter loads (host link)"
)
# No engine step is shorter than a kernel launch (microseconds): a shorter measured or
# fitted step time is a broken profile, and it would weigh ~1e6 times a real row in the fit.
MIN_STEP_S = 1e-6
# Nor longer than an hour: such a measured step is a broken file (seconds written as
# microseconds, a stalled host), and it would set the slow spells' dwells and level.
MAX_STEP_S = 3600.0


def design(df: pd.DataFrame) -> np.ndarray:
    """Feature matrix (rows, len(FEATURES)) of a frame with StepFeatures columns (without
    ``num_swap_tokens``: blocks of :data:`DEFAULT_BLOCK_SIZE` tokens; see
    :func:`with_swap_columns`)."""
    if "num_swap_tokens" not in df.columns or RUNS_COLUMN not in df.columns:
        df = with_swap_columns(df, DEFAULT_BLOCK_SIZE)
    prefills = df["num_prefills"].to_numpy(float)
    decodes = df["num_decodes"].to_numpy(float)
    tokens = df["num_prefill_tokens"].to_numpy(float) + decodes
    ctx = df["decode_context_tokens"].to_numpy(float)
    cols = [
        (prefills == 0).astype(float),
        (prefills > 0).astype(float),
        prefills + decodes,
        tokens,
        np.maximum(tokens - TOKEN_KNOT, 0.0),
        ctx / np.maximum(decodes, 1.0),
        ctx,
    ]
    cols += [
        df[c].to_numpy(float)
        for c in ("prefill_context_tokens", "prefill_attention_pairs", "num_swap_tokens")
    ]
    cols.append(np.maximum(tokens - EAGER_KNOT, 0.0))
    cols.append(df[RUNS_COLUMN].to_numpy(float))
    context = df["prefill_context_tokens"].to_numpy(float)
    paged = paged_pairs(tokens, df["num_prefill_tokens"].to_numpy(float), prefills, context)
    cols.append(np.where(paged, cols[_PAIRS], 0.0))
    return np.stack(cols, axis=1)


def paged_pairs(tokens, prompt_tokens, prefills, context_tokens):
    """Whether a step's prefill pairs run the paged Triton kernel, not FlashAttention varlen
    (module doc): arrays or scalars of its tokens (prompt tokens + decodes), prompt tokens,
    prompts and the cached tokens its chunks read."""
    return (
        (tokens <= EAGER_KNOT)
        | (context_tokens > 0)
        | (prompt_tokens < VARLEN_MIN_MEAN_CHUNK * prefills)
    )


def host_design(df: pd.DataFrame) -> np.ndarray:
    """Feature matrix (rows, len(HOST_FEATURES)) of the host-time fit."""
    prefills = df["num_prefills"].to_numpy(float)
    decodes = df["num_decodes"].to_numpy(float)
    cols = [
        (prefills == 0).astype(float),
        (prefills > 0).astype(float),
        prefills + decodes,
        df["num_prefill_tokens"].to_numpy(float) + decodes,
        df["prefill_context_tokens"].to_numpy(float) + df["decode_context_tokens"].to_numpy(float),
        df["num_swap_blocks"].to_numpy(float),
    ]
    return np.stack(cols, axis=1)


def fit_host(df: pd.DataFrame) -> np.ndarray:
    """Coefficients of :data:`HOST_FEATURES` (rows with a ``host_s``)."""
    x, y = host_design(df), df[HOST_COLUMN].to_numpy(float)
    d = df["duration_s"].to_numpy(float)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(x / scale / d[:, None], y / d) / scale


def nnls(a: np.ndarray, b: np.ndarray, free: tuple[int, ...] = ()) -> np.ndarray:
    """Least squares with every coefficient but those of columns ``free`` >= 0 (active-set
    elimination; for a handful of features)."""
    active = list(range(a.shape[1]))
    bounded = np.ones(a.shape[1], dtype=bool)
    bounded[list(free)] = False
    while True:
        coef = np.zeros(a.shape[1])
        coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        neg = [i for i in active if bounded[i] and coef[i] < 0]
        if not neg or len(active) == 1:
            return np.where(bounded, np.maximum(coef, 0.0), coef)
        active.remove(min(neg, key=lambda i: coef[i]))


def grid_rows(df: pd.DataFrame) -> np.ndarray:
    """Boolean mask of the profile grid's rows (not replay steps: ``kind`` != ``replay``);
    the optional terms are fitted only from enough of these."""
    return (df["kind"] != REPLAY_KIND).to_numpy() if "kind" in df else np.ones(len(df), bool)


def varlen_rows(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Boolean mask of the ``grid`` rows of design matrix ``x`` whose prefill pairs run
    FlashAttention varlen (pairs, none of them paged)."""
    return grid & (x[:, _PAIRS] > 0) & (x[:, _PAGED] == 0)


def fit(df: pd.DataFrame, extra: np.ndarray | None = None) -> np.ndarray:
    """Coefficients of :data:`FEATURES`, then those of ``extra`` ((rows, k) candidate
    features, each coefficient >= 0). Without any swap runs (unknown: module doc) the
    per-run coefficient is 0 and left out of the fit; so is the paged pairs' surcharge
    without ``MIN_EAGER_ROWS`` non-replay rows whose pairs run varlen."""
    x = design(df)
    varlen = varlen_rows(x, grid_rows(df))
    dropped = []  # in increasing order
    if not x[:, _RUNS].any():
        dropped.append(_RUNS)
    if varlen.sum() < MIN_EAGER_ROWS:
        dropped.append(_PAGED)
    coef = _fit(np.delete(x, dropped, axis=1), df, extra)
    for c in dropped:  # each back at its index, as 0
        coef = np.insert(coef, c, 0.0)
    return coef


def missing_step_kind(data: pd.DataFrame) -> str:
    """Why the base fit (rows without adapters) of ``data`` cannot price a kind of step: it
    has no decode-only steps or no steps with prompt tokens; empty when it has both."""
    lora = lora_rows(data)
    base = data[~lora] if lora.any() else data  # the base fit's rows (module doc, LoRA)
    prefills, decodes = base["num_prefills"].to_numpy(), base["num_decodes"].to_numpy()
    for kind, rows in (
        ("decode-only steps (num_prefills 0, num_decodes > 0)", (prefills == 0) & (decodes > 0)),
        ("steps with prompt tokens (num_prefills > 0)", prefills > 0),
    ):
        if not rows.any():
            return f"no {kind}: the fit cannot predict their time"
    return ""


def left_out_terms(df: pd.DataFrame) -> list[str]:
    """A sentence for each optional term :func:`fit` holds at 0 for want of rows of ``df``
    (c10, the eager slope; c12, the paged pairs' surcharge), naming the rows it needs; and
    one when c12 is fitted with fewer than ``MIN_EAGER_ROWS`` paged rows above the knot (it
    is then extrapolated there: module doc)."""
    x = design(df)
    grid = grid_rows(df)
    eager = int((x[grid, _EAGER] > 0).sum())
    varlen = int(varlen_rows(x, grid).sum())
    paged_eager = int((grid & (x[:, _EAGER] > 0) & (x[:, _PAGED] > 0)).sum())
    notes = []
    if eager < MIN_EAGER_ROWS:
        notes.append(
            f"c10 (the eager slope above {EAGER_KNOT} tokens) is 0: {eager} profile rows above "
            f"{EAGER_KNOT} tokens, the fit needs {MIN_EAGER_ROWS}"
        )
    if varlen < MIN_EAGER_ROWS:
        notes.append(
            f"c12 (the paged kernel's surcharge a prefill pair) is 0, c8 prices every pair: "
            f"{varlen} profile rows whose pairs run FlashAttention varlen (above {EAGER_KNOT} "
            f"tokens, chunks from position 0 of >= {VARLEN_MIN_MEAN_CHUNK} tokens on average), "
            f"the fit needs {MIN_EAGER_ROWS}; c12 is best fitted with both these and paged rows "
            f"above {EAGER_KNOT} tokens (chunks over a cached prefix)"
        )
    elif paged_eager < MIN_EAGER_ROWS:
        notes.append(
            f"c12 (the paged kernel's surcharge a prefill pair) is fitted mostly from CUDA-graph "
            f"rows: {paged_eager} profile rows above {EAGER_KNOT} tokens run the paged kernel "
            f"(chunks over a cached prefix, as `sched-lab profile`'s prefill_eager_prefix rows, "
            f"or of < {VARLEN_MIN_MEAN_CHUNK} tokens on average), {MIN_EAGER_ROWS} would pin it "
            "there; eager steps over a prefix-cache hit are priced by extrapolation"
        )
    return notes


def _fit(x: np.ndarray, df: pd.DataFrame, extra: np.ndarray | None) -> np.ndarray:
    """:func:`fit` on the design matrix ``x`` (columns ``_TOKENS``, ``_HINGE`` and
    ``_EAGER`` where FEATURES has them)."""
    y = df["duration_s"].to_numpy(float)
    num_features = x.shape[1]
    if extra is not None:
        x = np.concatenate([x, np.asarray(extra, float).reshape(len(df), -1)], axis=1)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    a = x / scale / y[:, None]
    coef = np.zeros(x.shape[1])
    grid = grid_rows(df)
    keep = [i for i in range(x.shape[1]) if i != _EAGER]
    eager = (x[grid, _EAGER] > 0).sum() >= MIN_EAGER_ROWS and len(df) >= num_features
    if eager:
        coef[:] = nnls(a, np.ones(len(y)), free=(_EAGER,)) / scale
        if coef[_EAGER] >= -(coef[_TOKENS] + coef[_HINGE]):
            return coef
        # the slope above the knot would be < 0: hold it at 0 (c10 = -(c3 + c4)) and refit
        x = x.copy()
        x[:, _TOKENS] -= x[:, _EAGER]
        x[:, _HINGE] -= x[:, _EAGER]
        scale = x.max(axis=0)
        scale[scale == 0] = 1.0
        a = x / scale / y[:, None]
    coef[keep] = nnls(a[:, keep], np.ones(len(y))) / scale[keep]
    coef[_EAGER] = 0.0 - (coef[_TOKENS] + coef[_HINGE]) if eager else 0.0  # never -0.0
    return coef


def lora_rows(df: pd.DataFrame) -> np.ndarray:
    """Boolean mask of the rows that ran LoRA adapters (``num_loras`` > 0; none without
    the column)."""
    if "num_loras" not in df.columns:
        return np.zeros(len(df), dtype=bool)
    return df["num_loras"].to_numpy(float) > 0


def lora_design(df: pd.DataFrame) -> np.ndarray:
    """Feature matrix (rows, len(LORA_FEATURES)) of the LoRA terms (module doc)."""
    loras = df["num_loras"].to_numpy(float)
    tokens = df["num_lora_tokens"].to_numpy(float)
    return np.stack([(loras > 0).astype(float), loras, tokens], axis=1)


def fit_lora(df: pd.DataFrame, base_s: np.ndarray) -> np.ndarray:
    """Coefficients of :data:`LORA_FEATURES` (each >= 0) fitted to rows with adapters whose
    base-model prediction is ``base_s`` seconds: least squares on the residual relative to
    each row's duration."""
    x, y = lora_design(df), df["duration_s"].to_numpy(float)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(x / scale / y[:, None], (y - base_s) / y) / scale


def fit_with_lora(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray | None]:
    """(:func:`fit` of the rows without adapters, :func:`fit_lora` of those with them, or
    None when there are none: then the first is ``fit(df)``)."""
    lora = lora_rows(df)
    if not lora.any():
        return fit(df), None
    coef = fit(df[~lora])
    with_lora = df[lora]
    return coef, fit_lora(with_lora, design(with_lora) @ coef)


def predict(df: pd.DataFrame, coef: np.ndarray, lora_coef: np.ndarray | None) -> np.ndarray:
    """Predicted seconds of each row: the base terms, plus the LoRA terms on rows with
    adapters when ``lora_coef`` is given."""
    pred = design(df) @ coef
    if lora_coef is None:
        return pred
    return pred + np.where(lora_rows(df), lora_design(df) @ lora_coef, 0.0)


def cross_validated_predictions(
    df: pd.DataFrame, folds: int = 5, seed: int = 0, rows: np.ndarray | None = None
) -> np.ndarray:
    """Seconds of every row of ``rows`` (a boolean mask; default all) predicted by a fit on
    the other folds of those rows plus every row outside them; NaN outside ``rows``."""
    rows = np.ones(len(df), bool) if rows is None else np.asarray(rows, bool)
    idx = np.flatnonzero(rows)
    order = idx[np.random.default_rng(seed).permutation(len(idx))]
    pred = np.full(len(df), np.nan)
    for k in range(folds):
        test = order[k::folds]
        train = np.setdiff1d(np.arange(len(df)), test)
        coef, lora_coef = fit_with_lora(df.iloc[train])
        pred[test] = predict(df.iloc[test], coef, lora_coef)
    return pred


def cross_validated_errors(df: pd.DataFrame, folds: int = 5, seed: int = 0) -> np.ndarray:
    """Held-out relative error of every row: predicted by a fit on the other folds."""
    y = df["duration_s"].to_numpy(float)
    return np.abs(cross_validated_predictions(df, folds, seed) - y) / y


def read_profile(path: str | Path) -> pd.DataFrame:
    """A profile CSV (``#`` header lines allowed), ``PROFILE_COLUMNS`` (and ``host_s``) as
    float64. Raises ConfigError (one line naming the file, row and column)."""
    path = Path(path)
    key = "cost_model.profile"
    if not path.exists():
        raise ConfigError(
            f"{key}: {path} does not exist (make one with `python -m sched_lab.backend.profile` on the GPU)"
        )
    df = _read_csv(path, key, comment="#")
    where = f"{key}: {path}"
    _require_columns(df, PROFILE_COLUMNS, where)
    # the eager slope, the per-run term and the paged pairs' surcharge are optional
    if len(df) < len(FEATURES) - 3:
        raise ConfigError(
            f"{where}: expected at least {len(FEATURES) - 3} rows (one per "
            f"fitted coefficient), got {len(df)}"
        )
    optional = tuple(c for c in (RUNS_COLUMN, HOST_COLUMN, *LORA_COLUMNS) if c in df.columns)
    if ("num_loras" in df.columns) != ("num_lora_tokens" in df.columns):
        raise ConfigError(
            f"{where}: expected both LoRA columns num_loras and num_lora_tokens, or neither"
        )

    def text() -> pd.DataFrame:  # the file as text, read only to quote a bad cell
        return _read_text(path, comment="#")

    df = check_cells(df, PROFILE_COLUMNS + optional, where, text)
    if "num_loras" in df.columns:
        check_lora_cells(df, where, text)
    # Profiles made before speculative decoding have no verify-step columns: none verified.
    df = df.assign(**{c: 0 for c in SPEC_COLUMNS if c not in df.columns})
    return with_swap_columns(df, profile_block_size(path))


def with_swap_columns(df: pd.DataFrame, block_size: int) -> pd.DataFrame:
    """``df`` with ``num_swap_tokens`` (its swapped blocks of ``block_size`` tokens) and
    ``num_swap_runs`` (0 where the frame has none: unknown, module doc)."""
    if "num_swap_tokens" not in df.columns:
        df = df.assign(num_swap_tokens=df["num_swap_blocks"] * block_size)
    return df if RUNS_COLUMN in df.columns else df.assign(**{RUNS_COLUMN: 0.0})


def profile_block_size(path: str | Path) -> int:
    """The block size a profile's header names (``block_size N``), else
    :data:`DEFAULT_BLOCK_SIZE`."""
    try:
        with Path(path).open(encoding="utf-8-sig", errors="replace") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                found = re.search(r"\bblock_size (\d+)", line)
                if found and int(found.group(1)) > 0:
                    return int(found.group(1))
    except OSError:
        pass
    return DEFAULT_BLOCK_SIZE


def profile_kv_dtype(path: str | Path) -> tuple[str, int]:
    """(KV dtype, model dtype bytes) of a profile from its header: ``kv_cache_dtype fp8``
    when named, else ``auto``; the model's bytes 4 for ``float32``, else 2."""
    kv, model_bytes = "auto", 2
    try:
        with Path(path).open(encoding="utf-8-sig", errors="replace") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                if re.search(r"\bkv_cache_dtype fp8\b", line):
                    kv = "fp8"
                if re.search(r"\bfloat32\b", line):
                    model_bytes = 4
    except OSError:
        pass
    return kv, model_bytes


def profile_lora_rank(path: str | Path) -> int | None:
    """The LoRA rank a profile's ``# lora: rank N`` header line names (backend/profile.py
    ``--lora-dir``), else None."""
    try:
        with Path(path).open(encoding="utf-8-sig", errors="replace") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                found = re.match(r"# lora: rank (\d+)", line)
                if found:
                    return int(found.group(1))
    except OSError:
        pass
    return None


def kv_bytes_ratio(run_kv_dtype: str, profile_kv_dtype: str, model_bytes: int) -> float:
    """KV bytes per token of the run over those of the profile (0.5 for an fp8 run on a
    bf16-KV profile, 1 when both match)."""
    run = kv_dtype_bytes(run_kv_dtype, model_bytes)
    return run / kv_dtype_bytes(profile_kv_dtype, model_bytes)


def read_fingerprint(path: str | Path) -> dict | None:
    """The engine fingerprint in a profile's header (:mod:`sched_lab.core.fingerprint`), or None."""
    try:
        with Path(path).open(encoding="utf-8-sig", errors="replace") as f:
            for line in f:
                if not line.startswith("#"):
                    return None
                if line.startswith(HEADER_PREFIX):
                    try:
                        fp = json.loads(line[len(HEADER_PREFIX) :])
                    except ValueError:
                        return None
                    return fp if isinstance(fp, dict) else None
    except OSError:
        return None
    return None


def staleness(fingerprint: dict | None, engine: dict) -> tuple[bool, str]:
    """(stale, why) of a profile for ``engine``'s fingerprint (what is known of the engine a
    run predicts, e.g. ``sched_lab.backend.sources.checkout_engine()``; keys it lacks are not
    compared); ``why`` is empty when not stale."""
    if fingerprint is None:
        return True, (
            "the profile has no engine fingerprint (made before fingerprints): which "
            "engine, GPU and versions it describes is unknown"
        )
    diff = differences(fingerprint, engine)
    if diff:
        return True, "the profile describes another engine: " + "; ".join(diff)
    return False, ""


def read_replay_steps(path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE) -> pd.DataFrame:
    """The steps.csv of an engine run (its blocks of ``block_size`` tokens) as profile rows.
    Raises ConfigError (one line)."""
    path = Path(path)
    key = "cost_model.replay_steps"
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    df = _read_csv(path, key)
    where = f"{key}: {path}"
    _require_columns(df, STEPS_COLUMNS, where, "not a steps.csv of a run: ")
    if len(df) == 0:
        raise ConfigError(f"{where}: no steps (a header without rows)")
    if "num_loras" in df.columns:  # steps with adapters are left out (module doc, LoRA)
        df = df[~(pd.to_numeric(df["num_loras"], errors="coerce").fillna(0) > 0)]
        if len(df) == 0:
            raise ConfigError(
                f"{where}: every step ran LoRA adapters, and steps with adapters are left "
                "out of the fit (steps.csv has no num_lora_tokens); expected some without"
            )
    return steps_as_profile(
        check_cells(df, STEPS_COLUMNS, where, lambda: _read_text(path)), block_size
    )


def replay_run_ids(path: str | Path) -> np.ndarray:
    """For each row :func:`read_replay_steps` keeps of ``path``, the index of the engine run
    it belongs to (0, 1, ...): a run starts at the first row and where ``policy`` or
    ``rate_scale`` changes or ``time_s`` goes back (the file appends runs)."""
    df = _read_csv(Path(path), "cost_model.replay_steps")
    if "num_loras" in df.columns:  # as read_replay_steps
        df = df[~(pd.to_numeric(df["num_loras"], errors="coerce").fillna(0) > 0)]
    new = np.zeros(len(df), bool)
    for col in ("policy", "rate_scale"):
        if col in df.columns:
            v = df[col].astype(str).to_numpy()
            new[1:] |= v[1:] != v[:-1]
    if "time_s" in df.columns:
        t = pd.to_numeric(df["time_s"], errors="coerce").to_numpy(float)
        new[1:] |= t[1:] < t[:-1]
    return np.cumsum(new)


def check_cells(
    df: pd.DataFrame, columns: tuple[str, ...], where: str, text: Callable[[], pd.DataFrame]
) -> pd.DataFrame:
    """``df`` with ``columns`` as float64, each cell finite; counts whole and >= 0, pairs
    >= 0, ``duration_s`` in [``MIN_STEP_S``, ``MAX_STEP_S``], ``host_s`` in [0, duration_s].
    ``text`` reads the file as text, to quote a bad cell. Raises ConfigError: ``{where}: row N
    (data rows from 1), column 'c': expected ..., got 'v'``."""
    df = df.copy()
    for c in columns:
        col = df[c]
        if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
            x = col.to_numpy(dtype=np.float64)  # as read_csv parsed it
        else:  # some cell is not a number: NaN there
            x = np.full(len(col), np.nan)
            if not pd.api.types.is_bool_dtype(col):
                x = pd.to_numeric(col, errors="coerce").to_numpy(np.float64, na_value=np.nan)
        checks = [(~np.isfinite(x), "expected a finite number")]
        if c == "duration_s":
            checks.append((x < MIN_STEP_S, f"expected a step duration >= {MIN_STEP_S:g} s"))
            checks.append((x > MAX_STEP_S, f"expected a step duration <= {MAX_STEP_S:g} s"))
        elif c == "prefill_attention_pairs":
            checks.append((x < 0, "expected a number >= 0"))
        elif c == HOST_COLUMN:
            checks.append((x < 0, "expected host seconds >= 0"))
            checks.append((x > df["duration_s"].to_numpy(float), "expected at most duration_s"))
        else:
            checks.append(((x < 0) | (x != np.floor(x)), "expected a whole count >= 0"))
        for bad, expected in checks:
            if bad.any():
                i = int(np.argmax(bad))
                raise ConfigError(
                    f"{where}: row {i + 1}, column {c!r}: {expected}, "
                    f"got {_show(text()[c].iloc[i])}"
                )
        df[c] = x
    return df


def check_lora_cells(df: pd.DataFrame, where: str, text: Callable[[], pd.DataFrame]) -> None:
    """The LoRA columns of ``df`` (checked by :func:`check_cells`) against the step's: at most
    one adapter per sequence, each feeding at least one token, and no more adapter tokens than
    the step feeds. Raises ConfigError as :func:`check_cells` does."""
    seqs = df["num_prefills"].to_numpy(float) + df["num_decodes"].to_numpy(float)
    spec = pd.to_numeric(df.get("num_spec_tokens", 0), errors="coerce")
    tokens = df["num_prefill_tokens"].to_numpy(float) + df["num_decodes"].to_numpy(float)
    tokens = tokens + np.nan_to_num(np.broadcast_to(np.asarray(spec, float), tokens.shape))
    loras, lora_tokens = df["num_loras"].to_numpy(float), df["num_lora_tokens"].to_numpy(float)
    checks = [
        ("num_loras", loras > seqs, seqs, "expected at most num_prefills + num_decodes ({:g}: "
         "one adapter per sequence)"),
        ("num_lora_tokens", lora_tokens < loras, loras, "expected at least num_loras ({:g}: "
         "each adapter feeds a token)"),
        ("num_lora_tokens", lora_tokens > tokens, tokens, "expected at most the step's tokens "
         "({:g}: num_prefill_tokens + num_decodes + num_spec_tokens)"),
    ]  # fmt: skip
    for c, bad, bound, expected in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise ConfigError(
                f"{where}: row {i + 1}, column {c!r}: {expected.format(bound[i])}, "
                f"got {_show(text()[c].iloc[i])}"
            )


def _read_text(path: Path, **kwargs) -> pd.DataFrame:
    return pd.read_csv(path, dtype=str, keep_default_na=False, **kwargs)


def _show(cell: str) -> str:
    return "'' (empty)" if cell == "" else _cut(cell)


def _cut(value: str, limit: int = 80) -> str:
    """``repr`` of a text, cut to ``limit`` characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _require_columns(
    df: pd.DataFrame, columns: tuple[str, ...], where: str, what: str = ""
) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        found = ", ".join(map(str, df.columns))
        found = found if len(found) <= 120 else found[:117] + "..."
        raise ConfigError(
            f"{where}: {what}missing column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}; expected columns: {', '.join(columns)} "
            f"(found: {found})"
        )


def _read_csv(path: Path, key: str, **kwargs) -> pd.DataFrame:
    """``pd.read_csv`` with one-line errors naming ``key`` and the file."""
    if not path.is_file():
        raise ConfigError(f"{key}: {path} is not a file (expected a CSV)")
    try:
        return pd.read_csv(path, **kwargs)
    except OSError as e:
        raise ConfigError(f"{key}: {path} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path} is not a text CSV (not UTF-8: byte {e.start})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{key}: {path} is not a readable CSV ({_cut(why, 120)[1:-1]})") from None


def steps_as_profile(df: pd.DataFrame, block_size: int = DEFAULT_BLOCK_SIZE) -> pd.DataFrame:
    """A steps.csv frame (blocks of ``block_size`` tokens) in the profile's columns; its swap
    runs are unknown (0)."""
    out = df.rename(columns={"num_decode_tokens": "num_decodes"})
    out["num_swap_blocks"] = df["num_swap_out_blocks"] + df["num_swap_in_blocks"]
    out["kind"] = REPLAY_KIND
    return with_swap_columns(out[["kind", *PROFILE_COLUMNS]], block_size)


class CalibratedCostModel:
    """Step durations fitted to an engine profile and optional engine steps.csv files."""

    #: ``step_time`` depends on its arguments alone (the simulator may fast-forward with it).
    deterministic: ClassVar[bool] = True

    def __init__(
        self,
        profile: str | Path,
        replay_steps: tuple[str | Path, ...] = (),
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``kv_cache_dtype``: the run's (module doc, "KV dtype"). Raises ConfigError: a bad
        file, no decode-only step or no step with prompt tokens, or a fit predicting less
        than ``MIN_STEP_S`` for a 1-token step."""
        self.profile = Path(profile)
        self.fingerprint = read_fingerprint(self.profile)
        self.block_size = profile_block_size(self.profile)  # of the profile's rows
        where = f"cost_model.profile: {self.profile}"
        if replay_steps:
            where += f" (with replay_steps {', '.join(map(str, replay_steps))})"
        grid = read_profile(self.profile)
        runs = [read_replay_steps(p, self.block_size) for p in replay_steps]
        data = pd.concat([grid, *runs], ignore_index=True)
        # each row's source: -1 the profile grid, i the i-th replay_steps file (for noise)
        self._source = np.repeat(np.arange(-1, len(runs)), [len(grid)] + [len(r) for r in runs])
        missing = missing_step_kind(data)
        if missing:
            raise ConfigError(f"{where}: {missing}")
        self.coef, self.lora_coef = fit_with_lora(data)
        self._data = data  # for noise
        self._replay_steps = tuple(replay_steps)  # for noise's spells
        timed = data[data[HOST_COLUMN].notna()] if HOST_COLUMN in data else data.iloc[:0]
        # host time fitted to the rows that have one (replay_steps rows have none)
        self.host_coef = fit_host(timed) if len(timed) else None
        self.host_note = "" if self.host_coef is not None else NO_HOST_NOTE
        # seconds per LoRA adapter loaded (set from the link by the simulator's setup)
        self.lora_load_s = 0.0
        # decode_step_time's functions for steps of decodes alone, by number of decodes
        self._decode_prices: dict[int, Callable[[int], float]] = {}
        # LoRA compute (module doc): l0, l1, l2, all 0 for a profile without adapter rows
        self.lora_rank = profile_lora_rank(self.profile)
        self.lora_note = "" if self.lora_coef is not None else NO_LORA_NOTE
        self._lora_step, self._per_lora, self._lora_token = (
            (0.0, 0.0, 0.0) if self.lora_coef is None else tuple(self.lora_coef.tolist())
        )
        (
            self._decode_step,
            self._prefill_step,
            self._seq,
            self._tok,
            self._hinge,
            self._mean_ctx,
            self._dctx,
            self._pctx,
            self._pairs,
            self._swap_token,
            self._eager,
            self._swap_run,
            self._paged_pairs,
        ) = self.coef.tolist()
        profile_kv, model_bytes = profile_kv_dtype(self.profile)
        self.kv_ratio = kv_bytes_ratio(kv_cache_dtype, profile_kv, model_bytes)
        if self.kv_ratio != 1.0:  # KV bytes read and swapped per token (module doc)
            self._dctx *= self.kv_ratio
            self._pctx *= self.kv_ratio
            self._swap_token *= self.kv_ratio
        for kind, f in (
            ("decode", StepFeatures(0, 0, 0, 0.0, 1, 1, 1, 0)),
            ("prefill", StepFeatures(1, 1, 0, 1.0, 0, 0, 1, 0)),
        ):
            t = self.step_time(f, 0)
            if not t >= MIN_STEP_S:  # NaN too
                raise ConfigError(
                    f"{where}: the fitted model predicts {t:.3g} s for a 1-token "
                    f"{kind}, expected >= {MIN_STEP_S:g} s"
                )

    @cached_property
    def noise(self) -> StepNoise:
        """What seeded replicas draw (lab/sim/noise.py): the residuals of every row fitted,
        the run factor's sigma and the host's slow spells. With replay_steps, the spells are
        fitted to the replay files' runs (``fit_spells``), and each replay step, less the
        offset of the state it was in, enters the residuals and the run factor (so the
        spells' share of the spread is drawn once, by the spells); that sigma is how far off
        whole runs the fit did not see are: each replay file left out in turn and predicted
        by a fit to everything else, the median log error of its steps of each kind (of at
        least MIN_ROWS steps) is one sample; sigma is their root mean square, one for every
        kind. Without them, or with no such sample, each profile row is predicted by a
        5-fold fit that left it out, per kind (an upper bound: one row is one shape, a run
        mixes many); without replay_steps, no spells (a profile row is a median of passes,
        not a sequence). Made on first use: only seeded runs ask."""
        data, source = self._data, self._source
        fitted = predict(data, self.coef, self.lora_coef)
        y = data["duration_s"].to_numpy(float)
        kinds = np.array([step_kind(p, d) for p, d in zip(data.num_prefills, data.num_decodes)])
        runs = self._replay_runs(fitted)
        spells = fit_spells(runs) if runs else None
        if spells is not None:  # each replay step without its state's offset: counted once
            y = y.copy()
            for rows, (m, p, d) in zip(self._run_rows, runs):
                y[rows] = np.maximum(y[rows] - spells.offsets(spells.states(m, p, d)), y[rows] / 2)
            data = data.assign(duration_s=y)
        samples = []
        for run in range(source.max() + 1):  # no replay file: no iteration
            out = source == run
            coef, lora_coef = fit_with_lora(data[~out])
            log_err = np.log(y[out] / predict(data[out], coef, lora_coef))
            for kind in KINDS:
                e = log_err[kinds[out] == kind]
                if len(e) >= MIN_ROWS:
                    samples.append(float(np.median(e)))
        if samples:
            sigma = float(np.sqrt(np.mean(np.square(samples))))
            return replace(fit_to_profile(data, fitted), run_sigma={k: sigma for k in KINDS},
                           spells=spells)  # fmt: skip
        # no replay file, or none with MIN_ROWS steps of a kind: the profile rows' own sigma
        noise = fit_to_profile(data, fitted, cross_validated_predictions(data, rows=source < 0))
        return replace(noise, spells=spells)

    def _replay_runs(self, fitted: np.ndarray) -> list[tuple]:
        """Each engine run in the replay files as (measured, fitted, decode-only) arrays of
        its steps in order (:func:`sched_lab.sim.noise.fit_spells`); ``_run_rows`` their
        rows in ``_data``."""
        data, source = self._data, self._source
        y = data["duration_s"].to_numpy(float)
        decode = (data["num_prefills"].to_numpy() == 0) & (data["num_decodes"].to_numpy() > 0)
        out, self._run_rows = [], []
        for i, path in enumerate(self._replay_steps):
            rows = np.flatnonzero(source == i)
            ids = replay_run_ids(path)
            if len(ids) != len(rows):  # not the file read at construction: no runs from it
                continue
            for run in range(ids.max() + 1 if len(ids) else 0):
                r = rows[ids == run]
                out.append((y[r], fitted[r], decode[r]))
                self._run_rows.append(r)
        return out

    def step_time(self, f: StepFeatures, block_size: int) -> float:
        """Predicted seconds of a step whose swapped blocks hold ``block_size`` tokens each."""
        tokens = f.num_prefill_tokens + f.num_decodes
        t = self._prefill_step if f.num_prefills else self._decode_step
        t += (
            self._seq * (f.num_prefills + f.num_decodes)
            + self._tok * tokens
            + self._dctx * f.decode_context_tokens
            + self._pctx * f.prefill_context_tokens
            + self._pairs * f.prefill_attention_pairs
            + self._swap_token * f.num_swap_blocks * block_size
            + self._swap_run * f.num_swap_runs
        )
        if f.num_lora_loads:  # priced from the link (lab/sim/cost_model.py LoRACost)
            t += self.lora_load_s * f.num_lora_loads
        if f.num_loras:  # fitted LoRA compute (0 for a profile without adapter rows)
            t += (
                self._lora_step
                + self._per_lora * f.num_loras
                + self._lora_token * f.num_lora_tokens
            )
        if f.num_decodes:
            t += self._mean_ctx * f.decode_context_tokens / f.num_decodes
        if f.prefill_attention_pairs and paged_pairs(
            tokens, f.num_prefill_tokens, f.num_prefills, f.prefill_context_tokens
        ):
            t += self._paged_pairs * f.prefill_attention_pairs
        if tokens > TOKEN_KNOT:
            t += self._hinge * (tokens - TOKEN_KNOT)
            if tokens > EAGER_KNOT:
                t += self._eager * (tokens - EAGER_KNOT)
        return t

    def decode_step_time(self, f: StepFeatures, block_size: int) -> Callable[[int], float]:
        """:meth:`step_time` of ``f`` as a function of its ``decode_context_tokens`` alone:
        ``price(ctx)`` equals ``step_time`` of ``f`` with that context, to the last bit (the
        same operations in the same order; the terms that do not depend on it computed
        once). For a run of steps that differ in their decodes' context only. A step of
        decodes alone (no prompt chunk, swap or adapter) is priced by one function per
        number of decodes, made on first use and kept."""
        pure = not (f.num_prefills or f.num_swap_blocks or f.num_loras or f.num_lora_loads)
        if pure:
            price = self._decode_prices.get(f.num_decodes)
            if price is not None:
                return price
        price = self._price_by_context(f, block_size)
        if pure:
            self._decode_prices[f.num_decodes] = price
        return price

    def _price_by_context(self, f: StepFeatures, block_size: int) -> Callable[[int], float]:
        """:meth:`decode_step_time`, made anew: with the context-free terms summed once for a
        step with decodes and no adapter, paged-pairs or token-knot term (the common case);
        else :meth:`step_time` of a copy of ``f`` given each context."""
        tokens = f.num_prefill_tokens + f.num_decodes
        num_decodes = f.num_decodes
        paged = f.prefill_attention_pairs and paged_pairs(
            tokens, f.num_prefill_tokens, f.num_prefills, f.prefill_context_tokens
        )
        if not num_decodes or f.num_lora_loads or f.num_loras or paged or tokens > TOKEN_KNOT:
            g = replace(f)

            def price(ctx: int) -> float:
                g.decode_context_tokens = ctx
                return self.step_time(g, block_size)

            return price
        t0 = self._prefill_step if f.num_prefills else self._decode_step
        seq_tok = self._seq * (f.num_prefills + num_decodes) + self._tok * tokens
        dctx, pctx = self._dctx, self._pctx * f.prefill_context_tokens
        pairs = self._pairs * f.prefill_attention_pairs
        swaps = self._swap_token * f.num_swap_blocks * block_size
        runs = self._swap_run * f.num_swap_runs
        mean_ctx = self._mean_ctx

        def price_decodes(ctx: int) -> float:  # step_time's operations, in its order
            return (
                t0
                + (seq_tok + dctx * ctx + pctx + pairs + swaps + runs)
                + (mean_ctx * ctx / num_decodes)
            )

        return price_decodes

    def host_time(self, f: StepFeatures, block_size: int = 0, step_s: float | None = None) -> float:
        """Predicted host seconds before launch, in [0, ``step_s``] (default: step time)."""
        if self.host_coef is None:
            return 0.0
        h0, h1, seq, tok, ctx, swap = self.host_coef
        host = (
            (h1 if f.num_prefills else h0)
            + seq * (f.num_prefills + f.num_decodes)
            + tok * (f.num_prefill_tokens + f.num_decodes)
            + ctx * (f.prefill_context_tokens + f.decode_context_tokens)
            + swap * f.num_swap_blocks
        )
        step_s = self.step_time(f, block_size) if step_s is None else step_s
        return min(max(host, 0.0), step_s)

    def device_time(self, f: StepFeatures, block_size: int = 0) -> float:
        """Predicted device seconds: step time - host time."""
        step_s = self.step_time(f, block_size)
        return step_s - self.host_time(f, block_size, step_s)

    def spec_step_time(self, f: StepFeatures, block_size: int) -> float:
        """Predicted seconds of a step whose decodes verify ``f.num_spec_tokens`` draft
        tokens: decode rows of 1 + d queries, each draft token at the per-token rate and its
        pairs at the per-pair rate (an extrapolation: profiles have no verify rows)."""
        t = self.step_time(f, block_size)
        if not f.num_spec_tokens:
            return t
        base = f.num_prefill_tokens + f.num_decodes
        total = base + f.num_spec_tokens
        # verify rows (1 + d queries each) run on the paged kernel, and so then do the
        # step's prompt chunks: FlashAttention varlen takes a step only when no sequence
        # after its chunks is fed more than one token (flash_varlen.varlen_prefix)
        if f.prefill_attention_pairs and not paged_pairs(
            base, f.num_prefill_tokens, f.num_prefills, f.prefill_context_tokens
        ):
            t += self._paged_pairs * f.prefill_attention_pairs
        t += self._tok * f.num_spec_tokens
        t += (self._pairs + self._paged_pairs) * f.spec_context_tokens
        t += self._hinge * (max(0, total - TOKEN_KNOT) - max(0, base - TOKEN_KNOT))
        t += self._eager * (max(0, total - EAGER_KNOT) - max(0, base - EAGER_KNOT))
        return t


def profile_shape(path: str | Path) -> tuple[str | None, str | None]:
    """(model preset, hardware preset) a profile's header names (``NVIDIA H200`` ->
    ``h200-sxm``), each None when unknown to the simulator."""
    from sched_lab.sim.hardware import HARDWARE
    from sched_lab.sim.models import MODELS

    model = hardware = None
    try:
        with Path(path).open(encoding="utf-8-sig", errors="replace") as f:
            head = [line for line in (f.readline() for _ in range(4)) if line.startswith("#")]
    except OSError:
        return None, None
    for line in head:
        if line.startswith("# model "):
            name = line[len("# model ") :].split(":")[0].strip()
            model = name if name in MODELS else None
        elif line.startswith("# engine profile,"):
            gpu = line.split(",")[2].strip().lower()  # "NVIDIA H200"
            hits = [h for h in HARDWARE if HARDWARE[h].kind == "datasheet"
                    and h.split("-")[0] in gpu.replace("nvidia", "").split()]  # fmt: skip
            hardware = hits[0] if hits else None
    return model, hardware


# Profile kinds the analytic roofline does not price: eager prompt chunks over a cached
# prefix run the paged attention kernel (a flops rate of its own; the calibrated model's c12),
# and with them in its fit one flops efficiency prices every prefill too slow (BENCHMARKS.md,
# "the analytic fits' lower flops efficiencies").
ROOFLINE_SKIPPED_KINDS = ("prefill_eager_prefix",)


def analytic_terms(
    df: pd.DataFrame, model: str, hardware: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(compute_s, memory_s, swap_s, duration_s) of the profile rows the roofline prices
    (all but :data:`ROOFLINE_SKIPPED_KINDS`): the analytic model's compute and memory terms
    at efficiency 1 and its swap term, one value a row, seconds; ``model`` and ``hardware``
    are preset names."""
    from sched_lab.sim.cost_model import AnalyticCostModel
    from sched_lab.sim.hardware import HARDWARE
    from sched_lab.sim.models import MODELS
    from sched_lab.sim.noise import profile_features

    if "kind" in df:
        df = df[~df["kind"].isin(ROOFLINE_SKIPPED_KINDS)]
    feats = profile_features(df)
    spec, hw = MODELS[model], HARDWARE[hardware]

    def times(flops_eff: float, bw_eff: float) -> np.ndarray:
        cm = AnalyticCostModel(spec, hw, flops_eff, bw_eff, 0.0)
        return np.array([cm.step_time(f, 16) for f in feats])

    huge = 1e12  # an efficiency so high that its term vanishes
    swap_s = times(huge, huge)
    compute_s, memory_s = times(1.0, huge) - swap_s, times(huge, 1.0) - swap_s
    return compute_s, memory_s, swap_s, df["duration_s"].to_numpy(float)


def fit_roofline(
    compute_s: np.ndarray, memory_s: np.ndarray, swap_s: np.ndarray, y: np.ndarray
) -> dict[str, float]:
    """``flops_efficiency``, ``bandwidth_efficiency`` (each on 40 geometric steps of 0.05-1)
    and ``step_overhead_s`` (0-5 ms by 50 us) minimizing the median relative error of
    ``max(compute_s / a, memory_s / b) + swap_s + overhead`` against ``y``, with that error."""
    effs = np.geomspace(0.05, 1.0, 40)
    overheads = np.linspace(0.0, 0.005, 101)
    best = (np.inf, 0.0, 0.0, 0.0)
    for a in effs:
        for b in effs:
            base = np.maximum(compute_s / a, memory_s / b) + swap_s
            err = np.abs(base[None, :] + overheads[:, None] - y) / y  # (overheads, rows)
            med = np.median(err, axis=1)
            i = int(np.argmin(med))
            if med[i] < best[0]:
                best = (float(med[i]), float(a), float(b), float(overheads[i]))
    return {
        "flops_efficiency": round(best[1], 3),
        "bandwidth_efficiency": round(best[2], 3),
        "step_overhead_s": round(best[3], 5),
        "median_relative_error": best[0],
    }


def fit_analytic(df: pd.DataFrame, model: str, hardware: str) -> dict[str, float]:
    """The analytic roofline's ``flops_efficiency``, ``bandwidth_efficiency`` and
    ``step_overhead_s`` fitted to a profile's rows (:func:`fit_roofline` over
    :func:`analytic_terms`: the kinds it prices), with the median relative error."""
    return {
        "model": model,
        "hardware": hardware,
        **fit_roofline(*analytic_terms(df, model, hardware)),
    }


BUNDLED_PROFILES = Path(str(files("sched_lab.profiles")))  # a checkout's, or in the wheel


def find_profile(name: str) -> Path:
    """The profile CSV ``name`` names: a path that exists, else a bundled profile (in
    :data:`BUNDLED_PROFILES`) by its name, with or without ``.csv`` and ``profiles/`` (``_``
    and ``-`` alike).
    Raises ConfigError for neither, listing the bundled ones."""
    path = Path(name).expanduser()
    if path.exists() or path.parent not in (Path("."), Path("profiles")):
        return path  # a path: read_profile says what is wrong with it
    stem = path.name.removesuffix(".csv")
    bundled = sorted(p.stem for p in BUNDLED_PROFILES.glob("*.csv"))
    same = [b for b in bundled if b.replace("_", "-") == stem.replace("_", "-")]  # _ or -
    if stem and len(same) == 1:
        return BUNDLED_PROFILES / f"{same[0]}.csv"
    raise ConfigError(
        f"{name} does not exist, and no bundled profile has that name"
        f"{did_you_mean(stem, bundled)} (bundled: {', '.join(bundled) or 'none'})"
    )


def main(
    argv: list[str] | None = None,
    prog: str = "python -m sched_lab.sim.calibrated",
    engine: dict | None = None,
) -> int:
    """Fit a profile, print the fit (``sched-lab fit``), and write it to ``--out`` if given;
    returns the exit status. ``engine``: what is known of this checkout's engine
    (``sched-lab fit`` passes its sources' hash, see :func:`staleness`); None: only a missing
    fingerprint is stale."""
    import argparse

    from sched_lab.core.errors import UserError
    from sched_lab.core.outputs import check_output, write_output

    ap = OneLineParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fit the calibrated step-time model to an engine profile; print the "
        "coefficients and their held-out (5-fold) relative errors, and write them to --out.",
        epilog="examples:\n  sched-lab fit h200_qwen3-0.6b    # a bundled profile, by name\n"
        "  sched-lab fit my_profile.csv --out my_profile.fit.json\n\n"
        "--out replaces only a file sched-lab wrote (listed in .sched-lab-manifest.json beside "
        "it).\n\nexit status: 0 ok, 2 bad input (one line: error: ...)",
    )
    ap.add_argument(
        "profile",
        help="profile CSV made by `sched-lab profile`, or a bundled profile's name "
        f"({', '.join(sorted(p.stem for p in BUNDLED_PROFILES.glob('*.csv')))})",
    )
    ap.add_argument("--out", help="the fit summary JSON to write (default: none, printed only)")
    args = ap.parse_args(argv)
    try:
        out = check_output(args.out, "--out") if args.out is not None else None
        path = find_profile(args.profile)
        df = read_profile(path)
        missing = missing_step_kind(df)  # as a run with this profile refuses it
        if missing:
            raise ConfigError(f"{path}: {missing}")
        coef, lora_coef = fit_with_lora(df)
        err = cross_validated_errors(df)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, hardware = profile_shape(path)
    base = df[~lora_rows(df)]  # the roofline's efficiencies: rows without adapters
    analytic = fit_analytic(base, model, hardware) if model and hardware else None
    kinds = df["kind"].fillna("unlabelled") if "kind" in df else pd.Series(["all"] * len(df))
    by_kind = {str(k): float(np.median(err[(kinds == k).to_numpy()])) for k in kinds.unique()}
    fingerprint = read_fingerprint(path)
    stale, why = staleness(fingerprint, engine or {})
    summary = {
        "profile": args.profile,
        "fingerprint": fingerprint,
        "stale_for_this_checkout": stale,
        "why": why,
        "rows": len(df),
        "coefficients": dict(zip(FEATURES, coef.tolist())),
        # the host part of each step (profile column host_s; null: the profile has none)
        "host_coefficients": (
            dict(zip(HOST_FEATURES, fit_host(df).tolist())) if HOST_COLUMN in df else None
        ),
        # what adapters add to a step (module doc, LoRA): only for a profile with such rows
        **(
            {
                "lora_coefficients": dict(zip(LORA_FEATURES, lora_coef.tolist())),
                "lora_rank": profile_lora_rank(path),
            }
            if lora_coef is not None
            else {}
        ),
        "held_out_relative_error": {
            "median": float(np.median(err)),
            "p90": float(np.percentile(err, 90)),
            "max": float(err.max()),
            "median_by_kind": by_kind,
        },
        # the analytic roofline's efficiencies fitted to the same rows (cost_model keys
        # flops_efficiency, bandwidth_efficiency, step_overhead_s), when the header names
        # a model and a GPU the simulator has presets for
        "analytic_fit": analytic,
    }
    if out is not None:
        try:
            write_output(out, json.dumps(summary, indent=2) + "\n")
        except UserError as e:
            print(f"error: --out {e}", file=sys.stderr)
            return 2
    print(json.dumps(summary, indent=2))
    if out is not None:
        print(f"wrote {out}")
    for note in left_out_terms(df[~lora_rows(df)]):
        print(f"note: {args.profile}: {note}", file=sys.stderr)
    if fingerprint is None:
        print(f"note: {args.profile}: {why}", file=sys.stderr)
    else:
        print(f"engine fingerprint: {json.dumps(fingerprint, sort_keys=True)}")
        if stale:
            print(f"note: {args.profile}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
