"""oneDNN-packed linear layers (worker/packed_linear.py): the same products
as F.linear at every row count, the packed copy really used from 8 rows, and
an eager CPU engine really running them (its greedy tokens are checked
against transformers by every oracle test in this folder)."""

import pytest
import torch
import torch.nn.functional as F

from tokenbudget.worker import packed_linear
from tokenbudget.worker.packed_linear import MIN_PACKED_ROWS, PackedLinear, prepack_linears

pytestmark = pytest.mark.skipif(
    not packed_linear.prepack_available(), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 64, 257])
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
    # The packed copy exists exactly when enough rows went through it.
    assert (net[0]._packed is not None) == (rows >= MIN_PACKED_ROWS)


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
