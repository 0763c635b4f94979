"""One tiny random-weight Qwen3 (byte-level BPE tokenizer) and one LLM over
it for the whole folder; its unconstrained text is garbage, so anything
well-formed it emits is the grammar's doing."""
from __future__ import annotations

import pytest

from tokenbudget.core import SamplingParams


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tokenbudget.worker.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="session")
def llm(tiny_model):
    from tokenbudget.server import LLM

    llm = LLM(tiny_model, num_gpu_blocks=512, max_num_seqs=64, max_model_len=1024)
    yield llm
    llm.shutdown()


@pytest.fixture
def sample(llm):
    """generate() of ``n`` temperature-1 runs under ``structured`` (seeds 0..n-1)."""
    def run(structured: dict, n: int = 50, max_tokens: int = 200, prompt: str = "Answer:"):
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens,
                                 structured=structured) for s in range(n)]
        return llm.generate([prompt] * n, params)
    return run


@pytest.fixture(scope="session")
def llm_async(tiny_model):
    """The same engine with async (overlap) scheduling."""
    from tokenbudget.server import LLM

    llm = LLM(tiny_model, num_gpu_blocks=512, max_num_seqs=64, max_model_len=1024,
              async_scheduling=True)
    yield llm
    llm.shutdown()


def assert_no_leaks(llm) -> None:
    """No request left, every KV block free, pool invariants hold."""
    sched = llm.engine.scheduler
    assert not sched.has_unfinished_requests()
    pool = sched.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


@pytest.fixture
def no_leaks():
    return assert_no_leaks


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def model_vocab_size(tiny_model) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model).vocab_size
