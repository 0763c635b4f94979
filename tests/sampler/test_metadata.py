"""SamplingMetadata.from_params turns per-request params into batch tensors."""

from __future__ import annotations

import pytest

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.sampler import SamplingMetadata, make_generator


def test_unused_filters_are_none_and_greedy_rows_are_neutral():
    params = [
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5, seed=1),
        SamplingParams(temperature=0.8),
    ]
    generators = [make_generator(1, "cpu"), None]
    md = SamplingMetadata.from_params(params, generators, "cpu")
    # The greedy row's filters and seed do not count: nothing needs filtering or a generator.
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.generators == {}
    assert not md.all_greedy and not md.all_random
    assert md.random_rows == [1]
    assert md.max_num_logprobs is None


def test_filter_tensors_hold_random_rows_values():
    params = [
        SamplingParams(temperature=0.5, top_k=7, logprobs=2),
        SamplingParams(temperature=0.0, top_k=3, logprobs=4),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=3),
    ]
    gen = make_generator(3, "cpu")
    md = SamplingMetadata.from_params(params, [None, None, gen], "cpu")
    assert md.temperature.tolist() == pytest.approx([0.5, 0.0, 1.0])
    assert md.top_k.tolist() == [7, -1, -1] and md.max_top_k == 7
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert md.top_p_index.tolist() == [1]  # position among the random rows [0, 2]
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.05])
    assert md.generators == {2: gen}
    assert md.max_num_logprobs == 4


def test_tiny_temperature_counts_as_greedy():
    md = SamplingMetadata.from_params([SamplingParams(temperature=1e-7)], [None], "cpu")
    assert md.all_greedy


def test_generator_list_must_match_params():
    with pytest.raises(ValueError, match="generators must have one entry per row"):
        SamplingMetadata.from_params([SamplingParams()] * 2, [None], "cpu")
