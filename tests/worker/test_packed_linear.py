"""oneDNN-packed linear layers (worker/packed_linear.py): the same products
as F.linear at every row count, the packed copy really used from MIN_PACKED_ROWS (2) rows
(from MAX_SMALL_ROWS + 1 where our small-rows kernel is built, which reads the plain weight), and
an eager CPU engine really running them (its greedy tokens are checked
against transformers by every oracle test in this folder)."""

import pytest
import torch
import torch.nn.functional as F

from tokenbudget.worker import packed_linear
from tokenbudget.worker.packed_linear import (
    MAX_SMALL_ROWS,
    MIN_PACKED_ROWS,
    PackedLinear,
    cpp_linear,
    prepack_linears,
    small_rows_kernel,
)

pytestmark = pytest.mark.skipif(
    not packed_linear.prepack_available(), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 64, 257])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    net = torch.nn.Sequential(torch.nn.Linear(48, 80, bias=bias))
    assert prepack_linears(net) == 1 and type(net[0]) is PackedLinear
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        got = net(x)
    want = F.linear(x, net[0].weight, net[0].bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The packed copy exists once enough rows went through it (at once where
    # our C++ op runs every row count).
    assert (net[0]._packed is not None) == (cpp_linear() is not None or rows >= MIN_PACKED_ROWS)


def test_a_wrong_packed_weight_shows(monkeypatch):
    """The comparison above can fail: pack a transposed-then-shuffled weight."""
    net = torch.nn.Sequential(torch.nn.Linear(32, 32))
    prepack_linears(net)
    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(
        packed_linear.torch.ops.mkldnn,
        "_reorder_linear_weight",
        lambda w, n: real(w.flip(0).contiguous(), n),
        raising=False,
    )
    x = torch.randn(16, 32)
    with torch.inference_mode():
        got = net(x)
    assert not torch.allclose(got, F.linear(x, net[0].weight, net[0].bias), atol=1e-3)


def test_only_fp32_cpu_linears_are_packed():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    assert prepack_linears(net) == 1
    assert type(net[0]) is PackedLinear and type(net[1]) is torch.nn.Linear


def test_an_eager_cpu_engine_multiplies_with_packed_weights(tiny_qwen3_path):
    from tokenbudget import LLM, SamplingParams

    llm = LLM(tiny_qwen3_path, enforce_eager=True, num_gpu_blocks=64)
    model = llm.engine.executor.worker.model_runner.model
    llm.generate(
        [{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=2, temperature=0)
    )
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    assert packed and any(m._packed is not None for m in packed)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 64])
@pytest.mark.parametrize("shape", [(48, 80), (37, 83), (256, 768)])
def test_the_op_a_compiled_decoder_calls_equals_f_linear(rows, shape):
    """tokenbudget_cpu::packed_linear (C++): our kernel on the plain weight up
    to MAX_SMALL_ROWS rows where built (else MKL below MIN_PACKED_ROWS), oneDNN
    on the packed weight above; each equals F.linear (ragged shapes: a column
    tail and a partial block of outputs), and a wrong copy of the weight shows
    exactly where that copy is read."""
    if cpp_linear() is None:
        pytest.skip("our C++ ops did not build")
    torch.manual_seed(rows)
    k, n = shape
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    got = torch.ops.tokenbudget_cpu.packed_linear(x, weight, packed, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    plain_rows = MAX_SMALL_ROWS if small_rows_kernel() else MIN_PACKED_ROWS - 1
    other = torch.ops.mkldnn._reorder_linear_weight(weight.flip(0).contiguous(), None)
    wrong = torch.ops.tokenbudget_cpu.packed_linear(x, weight, other, bias)
    assert torch.allclose(wrong, got, atol=1e-3) == (rows <= plain_rows)
    wrong = torch.ops.tokenbudget_cpu.packed_linear(x, weight.flip(0).contiguous(), packed, bias)
    assert torch.allclose(wrong, got, atol=1e-3) == (rows > plain_rows)


def test_a_compiled_cpu_decoder_multiplies_with_packed_weights(tiny_qwen3_path):
    """Compiling packs the weights up front (the trace takes them as inputs),
    and the compiled decoder gives the eager tokens (a mixed batch: decodes
    below MIN_PACKED_ROWS rows, a prefill above)."""
    from tokenbudget import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 37)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_qwen3_path, num_gpu_blocks=64).generate(prompts, params)]
    llm = LLM(tiny_qwen3_path, enforce_eager=False, num_gpu_blocks=64)
    runner = llm.engine.executor.worker.model_runner
    if runner.compiled is None:
        pytest.skip("the decoder did not compile here")
    packed = [m for m in runner.model.modules() if type(m) is PackedLinear]
    assert packed and all(m._packed is not None for m in packed)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
