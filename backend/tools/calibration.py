"""Calibrated 4-bit quantization (offline, CPU): AWQ's activation-aware scales and GPTQ's
error-correcting update, from the activations of a few prompts.

* AWQ (Lin et al., MLSys 2024): per input channel j a scale s_j = mean|x_j| ** alpha, alpha
  chosen on a grid in [0, 1] to minimise the projection's output error
  ``|Q(W diag(s)) diag(s)^-1 x - W x|^2`` on the calibration activations (alpha 0 is round to
  nearest, so the search never does worse on them). The scaled weight W diag(s) is stored and
  the inverse folded into the op before: the RMSNorm weight for q/k/v and gate/up, the up
  rows for down. o is not scaled (its input comes from v, which GQA shares among heads).
  Then, as AWQ's code does, each group of o, gate/up and down is clipped to the fraction of
  its largest |w| (1, 0.95, .., 0.55) that minimises its share of the output error.
* GPTQ (Frantar et al., ICLR 2023): H = 2 X^T X / T of the projection's inputs, dampened by
  1% of its mean diagonal; input columns are quantized one by one (in order of decreasing
  H_jj with act-order) and each one's error, divided by the Cholesky factor of H^-1, is
  taken out of the columns not yet quantized; a group's scale comes from its columns as
  they are when its first column is reached.

Layers are calibrated in order: each layer's inputs come from the layers before it already
quantized (the model runs the dequantized weights). Within a layer every projection sees
the float inputs of that layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sched_lab.backend.inputs import SeqInput
from sched_lab.backend.quant_formats import (
    QuantSpec,
    dequantize,
    fake_quantize_int4,
    int4_scale_zero,
    pack_int4,
    quantize_weight,
)
from sched_lab.core.errors import ConfigError

#: the repo's prompt file (chat prompts with output lengths); absent in a wheel install
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "experiments/data/smollm2_prompts.yaml"
AWQ_GRID = 20  # alphas 0, 1/20, .., 19/20
AWQ_CLIP_STEPS = 10  # clip limits 1, 0.95, .., 0.55 of a group's largest |w|
GPTQ_DAMP = 0.01  # fraction of H's mean diagonal added to it


@dataclass(frozen=True)
class CalibrationPrompt:
    prompt: str
    output_len: int  # tokens the float model appends greedily (their activations count too)


# ---------------------------------------------------------------- the algorithms
def awq_scales(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, grid: int = AWQ_GRID):
    """(s (K,), alpha) minimising the output error of W (N, K) quantized as W diag(s) on
    inputs x (T, K); s = 1 (alpha 0) is round to nearest."""
    w, x = w.float(), x.float()
    mean_abs = x.abs().mean(dim=0).clamp(min=1e-4)
    ref = x @ w.t()
    best = (float("inf"), torch.ones_like(mean_abs), 0.0)
    for i in range(grid):
        alpha = i / grid
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred in log scale: the codes' range is kept
        wq = fake_quantize_int4(w * s, spec) / s
        err = (x @ wq.t() - ref).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def awq_clip(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, steps: int = AWQ_CLIP_STEPS):
    """W (N, K) with each output's group clamped to +-(1 - i / 20) of its largest |w|, i in
    0..steps - 1 chosen per (output, group) for the least error of that group's share of
    the output on inputs x (T, K) (the AWQ code's clipping search; i = 0: no clipping)."""
    w, x = w.float(), x.float()
    n, k = w.shape
    g = spec.group_size
    xg = x.reshape(-1, k // g, g)  # (T, K/g, g)
    cov = torch.einsum("tjc,tjd->jcd", xg, xg) / xg.shape[0]  # (K/g, g, g): one per group
    wg = w.reshape(n, k // g, g)
    amax = wg.abs().amax(dim=2, keepdim=True)  # (N, K/g, 1)
    best_err = torch.full((n, k // g), float("inf"))
    best = wg.clone()
    for i in range(steps):
        limit = amax * (1 - i / 20)
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        q = fake_quantize_int4(clipped.reshape(n, k), spec).reshape(n, k // g, g)
        d = q - wg  # mean over tokens of (x_group . d)^2 = d^T cov d, (N, K/g)
        err = (torch.einsum("njc,jcd->njd", d, cov) * d).sum(dim=2)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[:, :, None], clipped, best)
    return best.reshape(n, k)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """GPTQ's H = 2 X^T X / T (K, K) float64 of inputs x (T, K)."""
    x = x.double()
    return 2.0 * x.t() @ x / x.shape[0]


def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor, spec: QuantSpec, damp: float = GPTQ_DAMP
) -> dict[str, torch.Tensor]:
    """The GPTQ checkpoint tensors of W (N, K) quantized against H (K, K) (module
    docstring); ``spec.act_order`` writes a g_idx in the columns' order of decreasing H_jj.
    The lazy update runs a group of columns at a time."""
    w = w.float().clone()
    n, k = w.shape
    g = spec.group_size
    h = h.double().clone()
    dead = torch.diag(h) == 0  # an input always 0: its column is never used
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(torch.diag(h), descending=True) if spec.act_order else torch.arange(k)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    # upper Cholesky factor of H^-1: row i holds how column i's error spreads to i + 1 ..
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    codes = torch.empty(n, k, dtype=torch.int32)
    scales, zeros = torch.empty(k // g, n), torch.empty(k // g, n)
    for b0 in range(0, k, g):  # one group per block
        wb, hb = w[:, b0 : b0 + g].clone(), hinv[b0 : b0 + g, b0 : b0 + g]
        scale, zero = int4_scale_zero(wb, spec.method, dim=1)  # (N,)
        scales[b0 // g], zeros[b0 // g] = scale, zero
        err = torch.empty_like(wb)
        for i in range(g):
            q = torch.round(wb[:, i] / scale + zero).clamp(0, 15)
            codes[:, b0 + i] = q.to(torch.int32)
            e = (wb[:, i] - (q - zero) * scale) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b0 + g :] -= err @ hinv[b0 : b0 + g, b0 + g :]
    out_codes = torch.empty_like(codes)
    out_codes[:, order] = codes  # back to the inputs' order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = torch.arange(k, dtype=torch.int32) // g
    return pack_int4(out_codes.t().contiguous(), zeros.to(torch.int32),
                     scales.to(torch.float16), spec, g_idx)  # fmt: skip


# ---------------------------------------------------------------- the model
def read_prompts(path: Path) -> list[CalibrationPrompt]:
    """The ``{prompt, output_len}`` items of a prompts YAML (the trace format's file)."""
    import yaml

    try:
        items = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--calibration-prompts {path}: cannot read YAML ({why})") from None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: expected a non-empty list of {{prompt, output_len}}")
    out = []
    for i, item in enumerate(items):
        prompt = item.get("prompt") if isinstance(item, dict) else None
        n = item.get("output_len", 0) if isinstance(item, dict) else None
        if not isinstance(prompt, str) or not prompt or not isinstance(n, int) or n < 0:
            raise ConfigError(
                f"{path}: item {i + 1}: expected a non-empty prompt and output_len >= 0"
            )
        out.append(CalibrationPrompt(prompt, n))
    return out


def chat_ids(model_dir: Path, prompts: list[CalibrationPrompt]) -> tuple[list[list[int]], int]:
    """Each prompt's token ids in the model's chat template, and the EOS id."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"--calibration data: no tokenizer in {model_dir} to read the prompts")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "--calibration data needs transformers: pip install transformers"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = [list(tok.apply_chat_template([{"role": "user", "content": p.prompt}],
                                            add_generation_prompt=True,
                                            return_dict=True)["input_ids"])
               for p in prompts]  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a foreign tokenizer, no chat template
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ConfigError(f"--calibration data: {model_dir}'s tokenizer: {why}") from None
    return ids, tok.eos_token_id


def greedy_continuations(runner, ids: list[list[int]], new_tokens: list[int], eos: int,
                         tables: list[list[int]]) -> list[list[int]]:  # fmt: skip
    """Each sequence followed by the model's greedy continuation of up to ``new_tokens``
    tokens (stopping after EOS); ``tables`` cover the longest result."""
    seqs = [list(s) for s in ids]
    fed = [0] * len(seqs)

    def live(i: int) -> bool:
        new = len(seqs[i]) - len(ids[i])
        return new < new_tokens[i] and not (new and seqs[i][-1] == eos)

    while any(live(i) for i in range(len(seqs))):
        step = [i for i in range(len(seqs)) if live(i)]
        inputs = [SeqInput(seqs[i][fed[i] :], fed[i], tables[i], True) for i in step]
        for i, token in zip(step, runner.execute(inputs), strict=True):
            fed[i] = len(seqs[i])
            seqs[i].append(int(token))
    return seqs


def _block_tables(lengths: list[int], block_size: int) -> list[list[int]]:
    tables, start = [], 0
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    return tables


def calibrate(model_dir: Path, spec: QuantSpec, prompts_path: Path) -> dict[str, torch.Tensor]:
    """The calibrated checkpoint tensors of ``model_dir`` (float, unquantized): every layer
    projection's packed tensors (``model.layers.L.self_attn.q_proj.qweight``, ..) and, for
    AWQ, the RMSNorm weights with the scales folded in. The model runs on the CPU in
    float32; the embedding, LM head and final norm are not touched."""
    from sched_lab.backend.runner import ModelRunner

    if spec.method not in ("awq", "gptq"):
        raise ConfigError(f"--calibration data: for awq and gptq only, not {spec.method}")
    prompts = read_prompts(prompts_path)
    ids, eos = chat_ids(model_dir, prompts)
    lengths = [len(i) + p.output_len for i, p in zip(ids, prompts)]
    tables = _block_tables(lengths, 16)
    runner = ModelRunner(model_dir, num_gpu_blocks=sum(map(len, tables)), swap_space_bytes=0,
                         max_model_len=max(lengths))  # fmt: skip
    seqs = greedy_continuations(runner, ids, [p.output_len for p in prompts], eos, tables)
    model, config = runner.model, runner.config
    captured: dict[str, tuple] = {}

    def grab_layer_args(_module, args):
        captured["args"] = args
        raise _Captured

    hook = model.layers[0].register_forward_pre_hook(grab_layer_args)
    try:
        runner.execute([SeqInput(s, 0, t, False) for s, t in zip(seqs, tables)])
    except _Captured:
        pass
    finally:
        hook.remove()
    x, residual, cos, sin, _, meta = captured["args"]
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            kv = runner.kv_cache.layers[i]
            inputs = _projection_inputs(layer, (x, residual, cos, sin, kv, meta))
            out.update(_calibrate_layer(layer, inputs, spec, config, f"model.layers.{i}"))
            x, residual = layer(x, residual, cos, sin, kv, meta)  # through the quantized layer
    return out


class _Captured(Exception):
    """Stops the model after layer 0's inputs are captured."""


def _projection_inputs(layer, args) -> dict[str, torch.Tensor]:
    """Each fused projection's input (T, K) when ``layer`` runs on ``args``."""
    inputs: dict[str, torch.Tensor] = {}
    modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}  # fmt: skip
    hooks = [m.register_forward_pre_hook(lambda _m, a, name=name: inputs.__setitem__(name, a[0]))
             for name, m in modules.items()]  # fmt: skip
    try:
        layer(*args)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def _calibrate_layer(layer, inputs, spec: QuantSpec, config, prefix: str):
    """Quantize one decoder layer's projections in place (their weights become the
    dequantized ones; AWQ: the norms take the inverse scales) and return its checkpoint
    tensors."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = {
        "qkv_proj": (attn.qkv_proj, f"{prefix}.self_attn", ("q_proj", "k_proj", "v_proj"),
                     (config.q_size, config.kv_size, config.kv_size)),
        "o_proj": (attn.o_proj, f"{prefix}.self_attn", ("o_proj",), (config.hidden_size,)),
        "gate_up_proj": (mlp.gate_up_proj, f"{prefix}.mlp", ("gate_proj", "up_proj"),
                         (config.intermediate_size,) * 2),
        "down_proj": (mlp.down_proj, f"{prefix}.mlp", ("down_proj",), (config.hidden_size,)),
    }  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    if spec.method == "awq":  # search every scale on the float weights, then fold them
        folds = {"qkv_proj": layer.input_layernorm.weight,
                 "gate_up_proj": layer.post_attention_layernorm.weight}  # fmt: skip
        scales = {name: awq_scales(parts[name][0].weight, inputs[name], spec)[0]
                  for name in ("qkv_proj", "gate_up_proj", "down_proj")}  # fmt: skip
        for name, norm in folds.items():
            parts[name][0].weight.mul_(scales[name])
            norm.div_(scales[name])
        up = mlp.gate_up_proj.weight[config.intermediate_size :]
        up.div_(scales["down_proj"][:, None])  # down's input is silu(gate) * up
        mlp.down_proj.weight.mul_(scales["down_proj"])
        out[f"{prefix}.input_layernorm.weight"] = layer.input_layernorm.weight.detach().clone()
        out[f"{prefix}.post_attention_layernorm.weight"] = (
            layer.post_attention_layernorm.weight.detach().clone()
        )
    for name, (module, owner, names, rows) in parts.items():
        w = module.weight.detach()
        if spec.method == "gptq":
            tensors = gptq_quantize(w, hessian(inputs[name]), spec)
        elif name == "qkv_proj":  # not clipped: AWQ's code leaves q and k (attention
            # scores) alone, and q, k, v are one fused weight here
            tensors = quantize_weight(w, spec)
        else:
            x = inputs[name] / (scales[name] if name in scales else 1.0)  # the inputs it sees
            tensors = quantize_weight(awq_clip(w, x, spec), spec)
        module.weight.copy_(dequantize(tensors, spec).to(w.dtype))
        for part, value in zip(names, _split_outputs(tensors, spec, rows), strict=True):
            out.update({f"{owner}.{part}.{t}": v.contiguous() for t, v in value.items()})
    return out


def _split_outputs(tensors: dict[str, torch.Tensor], spec: QuantSpec, rows) -> list[dict]:
    """A fused projection's 4-bit tensors split into its parts of ``rows`` outputs each."""
    out, start = [], 0
    for n in rows:
        a, b = start, start + n
        part = {
            "scales": tensors["scales"][:, a:b],
            "qzeros": tensors["qzeros"][:, a // 8 : b // 8],
        }
        if spec.method == "awq":
            part["qweight"] = tensors["qweight"][:, a // 8 : b // 8]
        else:
            part["qweight"], part["g_idx"] = tensors["qweight"][:, a:b], tensors["g_idx"].clone()
        out.append(part)
        start = b
    return out
