"""The engine backend's setup: the model loaded once, an executor per run. torch is imported
only inside functions."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sched_lab.config import ExperimentConfig, PolicyConfig, check_swap_blocks
from sched_lab.core.errors import ConfigError
from sched_lab.core.lora import adapter_names
from sched_lab.core.plan import Executor
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.setup.base import Setup, async_scheduling


class EngineSetup(Setup):
    """Step times measured on the real engine (one model, loaded once per process)."""

    name = "engine"
    process_pool = False  # one device, one model loaded in the driver's process
    token_ids = True

    def check(self) -> None:
        if importlib.util.find_spec("torch") is None:
            raise ConfigError(
                'backend: engine needs torch, which is not installed: pip install -e ".[engine]"'
            )

    def prepare(self) -> None:
        parts = engine_parts(self.cfg)
        self._make_executor, self.num_gpu_blocks, self.num_cpu_blocks = parts[:3]
        self.max_position, self._vocab_size = parts[3:]
        self._info: dict[str, Any] | None = None

    def prepare_trace(self, requests: list[Request]) -> None:
        """Prompt token ids: hash ids make shared prefixes real tokens."""
        from sched_lab.backend.engine import assign_prompt_tokens
        from sched_lab.traces.hash_tokens import assign_hash_prompt_tokens

        assign_hash_prompt_tokens(requests, self._vocab_size, self.cfg.seed)
        assign_prompt_tokens(requests, self._vocab_size, self.cfg.seed)

    def executor(
        self,
        pol: PolicyConfig,
        limits: SchedulerLimits,
        label: str,
        scale: float,
        seed: tuple[int, ...] | None = None,
    ) -> Executor:
        executor = self._make_executor(pol.speculative, async_scheduling(self.cfg, pol))
        if self._info is None:
            self._info = engine_info(self.cfg, executor)
        return executor

    def run_info(self) -> dict[str, Any]:
        assert self._info is not None, "run_info() before the first executor"
        return self._info

    def describe(self) -> str:
        e = self.cfg.engine
        return (
            f"real engine: model `{e.model_path}` on `{e.device}` ({e.dtype}, "
            f"{e.attention_backend} attention), measured step times"
        )

    def kv_device(self) -> str:
        return f"{self.cfg.engine.device} (engine)"

    def model_id(self) -> str:
        """The engine's model folder."""
        if self.cfg.engine.model_path is not None:
            return Path(self.cfg.engine.model_path).name
        return self.cfg.model

    def text_decoder(self) -> Callable[[list[int]], str] | None:
        return text_decoder(self.cfg)

    def model_dir(self) -> Path | None:
        return self.cfg.engine.model_path


def engine_parts(cfg: ExperimentConfig):
    """Load the model once. Returns (make_executor(speculative=None, async_scheduling=False),
    num_gpu_blocks, num_cpu_blocks, max_model_len, vocab_size); raises CheckpointError,
    DeviceError or KVCacheCapacityError."""
    from sched_lab.backend.config import ModelConfig
    from sched_lab.backend.errors import CheckpointError
    from sched_lab.backend.tp import check_tp_size
    from sched_lab.backend.tp_engine import TensorParallelRunner

    eng, kv = cfg.engine, cfg.kv_cache
    if eng.model_path is None or not eng.model_path.is_dir():
        raise CheckpointError(
            f"engine.model_path: {eng.model_path} is not a directory (make one with "
            f"`python -m sched_lab.backend.tools convert-smollm2` or `make-random-checkpoint`)"
        )
    _check_speculative(cfg)
    _check_int4_at_load(cfg)
    if eng.kn_weights and not eng.device.startswith("cuda"):  # the loader would ignore it
        raise ConfigError(
            f"engine.kn_weights: true is a cuBLAS weight layout, for CUDA only; engine.device "
            f"is {eng.device!r} (remove kn_weights, or run on cuda)"
        )
    kwargs = _runner_kwargs(cfg)
    if eng.tensor_parallel_size == 1:
        runner = _runner(eng.model_path, **kwargs)
    else:  # ranks 1..N-1 in their own processes; this process is rank 0 (backend/tp_engine.py)
        check_tp_size(ModelConfig.from_dir(eng.model_path), eng.tensor_parallel_size)
        from sched_lab.backend.loader import checkpoint_quantization

        quant = cfg.quantization or getattr(checkpoint_quantization(eng.model_path), "method", None)
        if quant is not None:
            raise ConfigError(
                f"engine.tensor_parallel_size: {eng.tensor_parallel_size} with {quant!r} "
                "weights is not supported (quantized weights run on one GPU): set it to 1"
            )
        runner = TensorParallelRunner(eng.model_path, eng.tensor_parallel_size, **kwargs)

    cache = getattr(runner, "runner", runner).kv_cache  # rank 0's, under TP
    check_swap_blocks(kv, runner.num_cpu_blocks, cache.block_bytes, eng.model_path.name)
    drafts: dict = {}  # draft runners, loaded once for all runs (backend/spec_decode.py)

    def make_executor(speculative=None, async_scheduling: bool = False):
        """With ``speculative``, a :class:`sched_lab.backend.spec_decode.SpecExecutor` (sync only:
        ConfigError with ``async_scheduling``)."""
        from sched_lab.backend.engine import EngineExecutor

        runner.generator.manual_seed(cfg.seed)  # each run samples the same way
        if speculative is None:
            return EngineExecutor(runner, eng.temperature)
        from sched_lab.backend.spec_decode import ASYNC_ERROR, SpecExecutor, spec_decoder_from

        if async_scheduling:
            raise ConfigError(ASYNC_ERROR)
        spec = spec_decoder_from(speculative, runner, eng.temperature, cfg.seed,
                                 cfg.scheduler.max_num_seqs, drafts)  # fmt: skip
        return SpecExecutor(spec)

    return (
        make_executor,
        runner.num_gpu_blocks,
        runner.num_cpu_blocks,
        runner.max_model_len,
        runner.config.vocab_size,
    )


def _check_speculative(cfg: ExperimentConfig) -> None:
    """ConfigError naming the first speculative policy the engine cannot run (beside LoRA
    adapters or tensor parallelism, or with a draft model of another vocabulary): before
    the model loads, not at that policy's run, after the runs before it."""
    from sched_lab.backend.config import ModelConfig
    from sched_lab.core.spec import draft_vocab_error

    tp = cfg.engine.tensor_parallel_size
    other = "LoRA adapters (lora:)" if cfg.lora is not None else ""
    other = other or (f"engine.tensor_parallel_size {tp}" if tp > 1 else "")
    for i, p in enumerate(cfg.policies):
        spec, where = p.speculative, f"policies[{i}] ({p.label})"
        if spec is None:
            continue
        if other:
            raise ConfigError(
                f"{where}: speculative decoding with {other} is not implemented on the "
                "engine; remove its speculative"
            )
        if spec.method == "draft" and spec.model is not None:
            draft = ModelConfig.from_dir(Path(spec.model).expanduser()).vocab_size
            target = ModelConfig.from_dir(cfg.engine.model_path).vocab_size
            error = draft_vocab_error(str(spec.model), draft, target)
            if error:
                raise ConfigError(f"{where}: {error}")


def _check_int4_at_load(cfg: ExperimentConfig) -> None:
    """ConfigError naming the key when ``quantization`` (awq, gptq) would quantize an
    unquantized checkpoint at load, in groups of 128 inputs, and a projection's width does
    not split into them (SmolLM2's 576)."""
    from sched_lab.backend.loader import checkpoint_index, checkpoint_quantization
    from sched_lab.backend.quant_formats import DEFAULT_GROUP_SIZE
    from sched_lab.backend.tools.quantize import unsplittable

    path = cfg.engine.model_path
    if cfg.quantization not in ("awq", "gptq") or checkpoint_quantization(path) is not None:
        return
    index = checkpoint_index(path)
    bad = unsplittable(index, cfg.quantization, DEFAULT_GROUP_SIZE)
    if bad is not None:
        raise ConfigError(
            f"quantization: {cfg.quantization} quantizes {path} at load in groups of "
            f"{DEFAULT_GROUP_SIZE} inputs (outputs in packs of 8), and its {bad} of shape "
            f"{list(index[bad].shape)} does not split into them; write a checkpoint with "
            f"smaller groups (sched-lab tools quantize --method {cfg.quantization} "
            "--group-size G, docs/quantization.md)"
        )


def _runner_kwargs(cfg: ExperimentConfig) -> dict[str, Any]:
    """The ModelRunner's keyword arguments from the config (backend/runner.py)."""
    eng, kv = cfg.engine, cfg.kv_cache
    return dict(
        device=eng.device,
        dtype=eng.dtype,
        attention_backend=eng.attention_backend,
        block_size=kv.block_size,
        num_gpu_blocks=kv.num_gpu_blocks,
        gpu_memory_utilization=kv.gpu_memory_utilization,
        swap_space_bytes=kv.swap_space_bytes,
        seed=cfg.seed,
        max_model_len=cfg.scheduler.max_model_len,
        max_num_batched_tokens=cfg.profile_num_batched_tokens,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        cuda_graphs=eng.cuda_graphs,
        mixed_graphs=eng.mixed_graphs,
        kn_weights=eng.kn_weights,
        num_threads=eng.num_threads,
        prefill_attention=eng.prefill_attention,
        triton_prefill_kernel=eng.triton_prefill_kernel,
        quantization=cfg.quantization,
        kv_cache_dtype=kv.dtype,
        **_lora_kwargs(cfg),
    )


def _lora_kwargs(cfg: ExperimentConfig) -> dict[str, Any]:
    """The runner's LoRA arguments from the ``lora:`` section (none when it is absent):
    adapters ``lora-0 .. lora-{N-1}`` read from ``lora.adapter_dir`` (PEFT folders)."""
    lora = cfg.lora
    if lora is None:
        return {}
    if lora.adapter_dir is None:
        raise ConfigError(
            "lora.adapter_dir: backend: engine needs a folder of PEFT adapters lora-0 .. "
            f"lora-{lora.num_adapters - 1} (make random ones with `sched-lab tools "
            "make-random-lora --model-dir MODEL --out DIR --count N --rank R`)"
        )
    if cfg.engine.tensor_parallel_size > 1:
        raise ConfigError("lora: adapters with engine.tensor_parallel_size > 1 are not implemented")
    from sched_lab.backend.lora import adapters_in_dir

    return dict(
        lora_adapters=adapters_in_dir(lora.adapter_dir, list(adapter_names(lora.num_adapters))),
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
    )


_RUNNER: dict[tuple, Any] = {}  # the last ModelRunner built, by its arguments


def _runner(model_path, **kwargs):
    """A ModelRunner, reused for the same arguments within a process (one kept)."""
    from sched_lab.backend.runner import ModelRunner

    key = (str(model_path), *sorted((k, repr(v)) for k, v in kwargs.items()))
    if key not in _RUNNER:
        _RUNNER.clear()
        _RUNNER[key] = ModelRunner(model_path, **kwargs)
    return _RUNNER[key]


def engine_info(cfg: ExperimentConfig, executor: Any) -> dict[str, Any]:
    """An engine run's summary key ``cost_model``: measured, with the engine fingerprint."""
    from sched_lab.backend.profile import engine_fingerprint

    runner = getattr(executor.runner, "runner", executor.runner)  # rank 0's, under TP
    tp = cfg.engine.tensor_parallel_size > 1
    options = ["tensor_parallel"] if tp else []
    if any(p.speculative is not None for p in cfg.policies):
        options.append("speculative")
    fp = engine_fingerprint(runner, cfg.engine.kn_weights, options)
    if tp:
        fp["tensor_parallel_size"] = cfg.engine.tensor_parallel_size
    return {"kind": "measured", "profile": None, "fingerprint": fp, "stale": False, "why": ""}


def text_decoder(cfg: ExperimentConfig) -> Callable[[list[int]], str] | None:
    """A token-ids -> text function from the model's tokenizer, or None without one."""
    model_dir = cfg.engine.model_path
    if (
        not (model_dir / "tokenizer.json").exists()
        and not (model_dir / "tokenizer_config.json").exists()
    ):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
