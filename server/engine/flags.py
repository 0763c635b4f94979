"""The ``server`` flags of the engine settings, derived from EngineArgs'
fields (server/engine/args.py) and SchedulerConfig's policy options: a flag
``--max-num-seqs`` is the keyword ``max_num_seqs``; vLLM's names for our
settings (``ALIASES``) are further option strings."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from tokenbudget.core.config import POLICY_OPTIONS, SchedulerConfig
from tokenbudget.server.engine.args import ALIASES, EngineArgs


def engine_flags() -> list[tuple[str, list[str], dict[str, Any]]]:
    """The flag of every engine setting, derived from its field: (group,
    option strings, add_argument keywords), for EngineArgs' fields and
    SchedulerConfig's policy options; dest is the field's name and the
    default its default. vLLM's names (ALIASES) are further option strings."""
    policy = (f for f in dataclasses.fields(SchedulerConfig) if f.name in POLICY_OPTIONS)
    return [_flag(f) for f in (*dataclasses.fields(EngineArgs), *policy) if "help" in f.metadata]


def _flag(f: dataclasses.Field) -> tuple[str, list[str], dict[str, Any]]:
    meta = f.metadata
    names = [
        "--" + f.name.replace("_", "-"),
        *meta.get("flags", ()),
        *("--" + alias.replace("_", "-") for alias, name in ALIASES.items() if name == f.name),
    ]
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
    kwargs.update((key, meta[key]) for key in ("choices", "metavar", "nargs") if key in meta)
    kinds = {t.strip() for t in str(f.type).split("|")} - {"None"}
    if kinds == {"bool"}:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif "parse" in meta:
        kwargs["type"] = _argument_type(meta["parse"])
    elif kinds in ({"int"}, {"float"}):
        kwargs["type"] = int if kinds == {"int"} else float
    # Anything else is taken as text, which the config parses (sizes, JSON).
    return meta["group"], names, kwargs


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError's message is the flag's error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert
