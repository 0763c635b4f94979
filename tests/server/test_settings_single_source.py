"""Each engine setting is declared once, in its dataclass field: the ``server``
flag's default is that field's default, and every field is a flag and an
``LLM(...)`` keyword (tests/grpc/test_engine_settings_reachable.py checks the
values reach the configs)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenbudget.core.config import POLICY, POLICY_OPTIONS, CacheConfig, SchedulerConfig
from tokenbudget.proto import convert
from tokenbudget.server.engine.args import ALIASES, EngineArgs
from tokenbudget.server.entrypoints import cli

# Config field -> the EngineArgs field (and flag) that sets it, where the names differ.
ENGINE_NAME = {
    "num_blocks": "num_gpu_blocks",
    "kv_cache_memory_bytes": "kv_cache_memory",
    "kv_offload_memory_bytes": "kv_offload_memory",
}
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
# Fields the engine derives from the workers (metadata "derived") are no settings.
CONFIG_FIELDS = [
    f
    for config in (SchedulerConfig, CacheConfig)
    for f in dataclasses.fields(config)
    if not f.metadata.get("derived")
]
# The settings that are flags: EngineArgs' fields (not its policy_options dict) and
# SchedulerConfig's policy options.
FLAG_FIELDS = [f for f in dataclasses.fields(EngineArgs) if f.name != "policy_options"] + [
    f for f in dataclasses.fields(SchedulerConfig) if f.name in POLICY_OPTIONS
]


def _actions() -> dict[str, argparse.Action]:
    """Option string -> its action."""
    return {o: a for a in cli.build_parser()._actions for o in a.option_strings}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("f", FLAG_FIELDS, ids=[f.name for f in FLAG_FIELDS])
def test_engine_flag_default_and_help_are_its_fields(f):
    action = _actions()[_flag(f.name)]
    assert action.dest == f.name
    assert action.default == f.default
    assert action.help == f.metadata["help"]
    assert getattr(cli.build_parser().parse_args([]), f.name) == f.default


@pytest.mark.parametrize("f", CONFIG_FIELDS, ids=[f.name for f in CONFIG_FIELDS])
def test_every_config_field_is_a_flag_and_an_llm_keyword(f):
    name = ENGINE_NAME.get(f.name, f.name)
    assert _flag(name) in _actions()
    if f.name in POLICY_OPTIONS:
        assert f.metadata["group"] == POLICY
        assert EngineArgs.from_kwargs("m", **{name: f.default}).policy_options == {name: f.default}
    else:
        assert name in ENGINE_FIELDS
        # One declaration: the EngineArgs field carries the config field's flag.
        assert ENGINE_FIELDS[name].metadata["help"] == f.metadata["help"]


def test_engine_defaults_are_the_config_defaults_but_where_engine_args_says_otherwise():
    differ = {}
    for f in CONFIG_FIELDS:
        engine = ENGINE_FIELDS.get(ENGINE_NAME.get(f.name, f.name))
        if engine is not None and engine.default != f.default:
            differ[f.name] = (f.default, engine.default)
    # async scheduling is on for server and LLM (a hand-built SchedulerConfig
    # runs EngineCore's synchronous loop); max_model_len None: the model's.
    assert differ == {"async_scheduling": (False, True), "max_model_len": (8192, None)}
    assert (
        SchedulerConfig.__dataclass_fields__["async_scheduling"].metadata["engine_default"] is True
    )


def test_default_engine_args_give_the_default_configs():
    args = EngineArgs()
    assert args.cache_config() == CacheConfig()
    assert args.scheduler_config(8192) == SchedulerConfig(async_scheduling=True)


def test_vllm_names_are_flags_and_llm_keywords_of_the_same_setting():
    actions = _actions()
    for alias, name in ALIASES.items():
        assert actions[_flag(alias)] is actions[_flag(name)]
        assert EngineArgs.from_kwargs("m", **{alias: None}).model == "m"


def test_policy_options_are_the_policy_group_of_scheduler_config():
    assert POLICY_OPTIONS == tuple(
        f.name for f in dataclasses.fields(SchedulerConfig) if f.metadata["group"] == POLICY
    )
    assert len(POLICY_OPTIONS) == 20


def test_worker_proto_carries_the_scheduler_fields_it_declares():
    assert convert._SCHED_FIELDS == (
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "long_prefill_token_threshold",
        "policy",
        "encoder_compute_budget",
        "encoder_cache_size",
        "async_scheduling",
    )
