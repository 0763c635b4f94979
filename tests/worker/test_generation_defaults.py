"""Sampling defaults come from the model's generation_config.json, as in vLLM:
they fill what a request leaves unset (LLM.generate without sampling_params;
unset fields over gRPC), a request's own values win, and
generation_config="vllm" ignores the file."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.proto import generate_pb2
from tokenbudget.server import LLM
from tokenbudget.server.entrypoints.client import make_request
from tokenbudget.server.entrypoints.grpc.generation import GenerationServicer
from tokenbudget.server.testing.tiny_models import build_tiny_decoder

PROMPTS = [[100, 200, 300, 400, 500], [700, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
FILE = {"temperature": 0.0, "top_k": 40, "max_new_tokens": 10, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def greedy_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3 whose generation_config.json asks for greedy, 10 tokens."""
    return build_tiny_decoder(
        tmp_path_factory.mktemp("greedy_by_default"), "qwen3", seed=0, generation_config=FILE
    )


@pytest.fixture(scope="module")
def llm(greedy_checkpoint):
    llm = LLM(greedy_checkpoint, num_gpu_blocks=32, max_model_len=256)
    yield llm
    llm.shutdown()


def test_no_sampling_params_gives_the_checkpoints_greedy_output(llm, greedy_checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(greedy_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=10, do_sample=False, temperature=None, top_k=None
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS])
    assert [o.token_ids for o in outs] == expected
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_k=40, max_tokens=10
    )


def test_a_sampling_params_given_is_used_as_is(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    sampled = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].token_ids
    greedy = llm.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )[0].token_ids
    assert len(sampled) == 6 and sampled != greedy


def test_generation_config_vllm_ignores_the_file(greedy_checkpoint, tmp_path):
    ignoring = LLM(greedy_checkpoint, num_gpu_blocks=8, max_model_len=64, generation_config="vllm")
    assert ignoring.get_default_sampling_params() == SamplingParams()
    ignoring.shutdown()
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.5, "min_p": 0.1}')
    elsewhere = LLM(
        greedy_checkpoint, num_gpu_blocks=8, max_model_len=64, generation_config=str(tmp_path)
    )
    assert elsewhere.get_default_sampling_params() == SamplingParams(top_p=0.5, min_p=0.1)
    elsewhere.shutdown()


def test_grpc_unset_fields_take_the_defaults_and_set_ones_win(greedy_checkpoint):
    from tokenbudget.server.entrypoints import cli

    ns = cli.build_parser().parse_args(
        [
            "--model",
            greedy_checkpoint,
            "--port",
            "0",
            "--num-gpu-blocks",
            "8",
            "--max-model-len",
            "64",
        ]
    )
    engine = cli.build_engine(ns)
    try:
        servicer = GenerationServicer(engine)
        _, [req] = servicer._make_requests(generate_pb2.GenerateRequest(text="hi"))
        assert (
            req.sampling_params.temperature,
            req.sampling_params.top_k,
            req.sampling_params.max_tokens,
        ) == (0.0, 40, 10)
        # The Client sends only the fields it is given.
        request = make_request("hi", SamplingParams(temperature=0.7), only={"temperature"})
        _, [req] = servicer._make_requests(request)
        assert (
            req.sampling_params.temperature,
            req.sampling_params.top_k,
            req.sampling_params.max_tokens,
        ) == (0.7, 40, 10)
    finally:
        engine.shutdown()
