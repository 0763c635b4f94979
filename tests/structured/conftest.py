"""One tiny random-weight Qwen3 (byte-level BPE tokenizer) and one LLM over
it for the whole folder; its unconstrained text is garbage, so anything
well-formed it emits is the grammar's doing."""

from __future__ import annotations

import pytest

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.structured.manager import StructuredOutputManager


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

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
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured=structured)
            for s in range(n)
        ]
        return llm.generate([prompt] * n, params)

    return run


@pytest.fixture(scope="session")
def llm_async(tiny_model):
    """The same engine with async (overlap) scheduling."""
    from tokenbudget.server import LLM

    llm = LLM(
        tiny_model, num_gpu_blocks=512, max_num_seqs=64, max_model_len=1024, async_scheduling=True
    )
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


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2 byte-level alphabet: the character each byte is written as -> the byte."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@pytest.fixture(scope="session")
def token_bytes(tokenizer) -> dict[int, bytes]:
    """Byte string of every ordinary (non-special) token id."""
    decode = _bytes_to_unicode()
    special = set(tokenizer.all_special_ids) | {
        i for t, i in tokenizer.get_vocab().items() if t.startswith("<|")
    }
    return {
        i: bytes(decode[ch] for ch in t)
        for t, i in tokenizer.get_vocab().items()
        if i not in special
    }


@pytest.fixture
def manager(tokenizer, model_vocab_size):
    m = StructuredOutputManager(tokenizer, model_vocab_size)
    yield m
    m.shutdown()


@pytest.fixture
def ready_request(manager, tokenizer):
    """A request under ``spec`` whose grammar compiled and whose matcher exists."""

    def make(rid: str, spec: dict, prompt_len: int = 5) -> Request:
        req = Request(
            rid,
            list(range(10, 10 + prompt_len)),
            SamplingParams(max_tokens=32, structured=spec),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
        manager.add_request(req)
        req.structured_request.compiled.result(timeout=30)
        assert manager.is_ready(req)
        return req

    return make
