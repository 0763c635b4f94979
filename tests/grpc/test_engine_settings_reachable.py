"""Every engine setting (each SchedulerConfig and CacheConfig field) is a
``server`` flag and an ``LLM(...)`` keyword under one snake-case name, and a
value given either way reaches the config: a new field cannot be forgotten."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenbudget.core.config import POLICY_OPTIONS, CacheConfig, SchedulerConfig
from tokenbudget.core.spec_config import SpeculativeConfig
from tokenbudget.server.entrypoints import cli
from tokenbudget.server.engine.args import EngineArgs

# Config field -> the engine argument that sets it, where the names differ
# (vLLM's names: --num-gpu-blocks, --kv-cache-memory).
ENGINE_ARG = {
    "num_blocks": "num_gpu_blocks",
    "kv_cache_memory_bytes": "kv_cache_memory",
    "kv_offload_memory_bytes": "kv_offload_memory",
}
# A valid value other than the default, where "the default changed a little" is not one.
OTHER_VALUE = {
    "policy": "lpm",
    "preemption_mode": "retract",
    "hash_algo": "xxhash",
    "tenant_weights": {"a": 2.0},
    "num_blocks": 64,
    "kv_cache_memory_bytes": 1 << 20,
    "admission_reserve": True,
    "gpu_memory_utilization": 0.5,
    "hash_seed": 7,
    "kv_offload_memory_bytes": 8 << 30,
    "num_offload_blocks": 64,
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
}
# The value a setting holds in its config when given as in OTHER_VALUE, where they differ.
IN_CONFIG = {"speculative_config": SpeculativeConfig("ngram", 3, 2, 4)}

# Fields the engine derives from the workers (metadata "derived") are no settings.
FIELDS = [
    (config, f)
    for config in (SchedulerConfig, CacheConfig)
    for f in dataclasses.fields(config)
    if not f.metadata.get("derived")
]


ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def _other_value(f: dataclasses.Field):
    """A valid value other than what the field gets when nothing is given."""
    if f.name in OTHER_VALUE:
        return OTHER_VALUE[f.name]
    default = ENGINE_DEFAULTS.get(ENGINE_ARG.get(f.name, f.name))
    if default is None or default is dataclasses.MISSING:
        default = f.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default / 2
    raise AssertionError(f"{f.name}: add a non-default value to OTHER_VALUE")


def _argv(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


def _configs(args: EngineArgs):
    return {
        SchedulerConfig: args.scheduler_config(args.max_model_len or 8192),
        CacheConfig: args.cache_config(),
    }


@pytest.mark.parametrize("config, f", FIELDS, ids=[f.name for _, f in FIELDS])
def test_every_engine_setting_is_a_flag_and_an_llm_keyword_that_reaches_the_config(
    config, f, monkeypatch
):
    import sys
    import types

    # hash_algo="xxhash" is refused without the optional package: stand one in.
    monkeypatch.setitem(sys.modules, "xxhash", types.ModuleType("xxhash"))
    name = ENGINE_ARG.get(f.name, f.name)
    value = _other_value(f)
    expected = IN_CONFIG.get(f.name, value)
    from_kwargs = EngineArgs.from_kwargs("m", **{name: value})
    assert getattr(_configs(from_kwargs)[config], f.name) == expected
    ns = cli.build_parser().parse_args(_argv(name, value))
    assert getattr(_configs(EngineArgs.from_cli_args(ns))[config], f.name) == expected


def test_policy_options_are_scheduler_config_fields():
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert set(POLICY_OPTIONS) <= fields


def test_llm_and_server_share_one_async_scheduling_default_on():
    assert EngineArgs().async_scheduling is True
    assert cli.build_parser().parse_args([]).async_scheduling is True
    assert "default" in next(
        a.help
        for a in cli.build_parser()._actions
        if a.dest == "async_scheduling" and a.option_strings[0] == "--async-scheduling"
    )
