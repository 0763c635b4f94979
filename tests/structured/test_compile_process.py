"""Grammars compiled in child processes (issue 26 items 4b and 13): a compile
past its timeout is stopped by killing its process, the next compile runs at
once, and the cache counts what a grammar really holds in the server (the
size its compiler process measured), not xgrammar's memory_size_bytes, which
misses most of a JSON schema's grammar."""

from __future__ import annotations

import json
import time

import pytest

from tokenbudget.core.sampling_params import StructuredOutputParams
from tokenbudget.core.structured.grammar import GrammarError
from tokenbudget.core.structured.manager import GrammarTimeoutError, StructuredOutputManager

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def manager(tiny_qwen3_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    m = StructuredOutputManager(
        tokenizer, 1280, compile_timeout_s=TIMEOUT_S, compile_in_process=True
    )
    yield m
    m.shutdown()


def _schema(properties: int) -> StructuredOutputParams:
    props = {f"p{i}": {"type": "string"} for i in range(properties)}
    return StructuredOutputParams(json_schema=json.dumps({"type": "object", "properties": props}))


def test_the_cache_counts_what_a_grammar_holds(manager):
    grammar = manager._compiled(_schema(40)).result(120)
    # Measured in the compiler process, which deserialized it as this one does.
    assert grammar.measured_bytes > 2 * grammar.memory_size_bytes
    assert manager.cached_bytes == grammar.measured_bytes


def test_a_compile_past_its_timeout_is_killed_and_the_next_one_runs(manager):
    manager._compiled(StructuredOutputParams(regex="[ab]+")).result(120)  # children ready
    kills = manager._processes.kills
    start = time.monotonic()
    # Optional properties: its compile grows about with their square (seconds here).
    with pytest.raises(GrammarTimeoutError, match="did not compile within 1 s"):
        manager._compiled(_schema(6000)).result(60)
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert manager._processes.kills == kills + 1
    assert manager._compiled(StructuredOutputParams(regex="x[0-9]")).result(30) is not None
    with pytest.raises(GrammarError, match="structured.regex"):
        manager._compiled(StructuredOutputParams(regex="(ab")).result(30)
