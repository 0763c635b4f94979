"""LLM.chat like vLLM's: one conversation or several, the tokenizer's chat
template or one given for the call; and LLM's per-request limits."""

from __future__ import annotations

import pytest

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello! How are you today?"}]
CAPITAL = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    llm = LLM(tiny_qwen3_path, num_gpu_blocks=32, max_model_len=256, max_logprobs=2)
    yield llm
    llm.shutdown()


def test_chat_renders_one_conversation_with_the_chat_template(llm):
    [out] = llm.chat(HELLO, GREEDY)
    text = llm.tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert (
        out.token_ids
        == llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY)[0].token_ids
    )


def test_chat_takes_a_list_of_conversations(llm):
    outs = llm.chat([HELLO, CAPITAL], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [
        llm.chat(c, GREEDY)[0].prompt_token_ids for c in (HELLO, CAPITAL)
    ]
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids


def test_chat_template_given_for_the_call_replaces_the_tokenizers(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    [out] = llm.chat(CAPITAL, GREEDY, chat_template=template, add_generation_prompt=False)
    expected = "[system] Be brief.\n[user] What is the capital of France?\n"
    assert llm.tokenizer.decode(out.prompt_token_ids) == expected


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_asking_more_logprobs_than_max_logprobs_is_refused(llm, field):
    with pytest.raises(ValueError, match=rf"sampling_params.{field} must be <= max_logprobs \(2"):
        llm.generate("hi", SamplingParams(**{field: 3}))
    assert llm.generate("hi", SamplingParams(max_tokens=2, **{field: 2}))[0].token_ids
