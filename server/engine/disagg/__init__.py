"""Disaggregated prefill/decode (issue 28): the settings, the prefill's
bootstrap listener, and the two KV connectors (core/kv/connector.py) that
the scheduler drives: PrefillConnector on a ``--disaggregation-mode
prefill`` engine, DecodeConnector on a ``decode`` one."""

from tokenbudget.server.engine.disagg.config import (
    DisaggregationConfig,
    check_disaggregation,
    parse_kv_transfer_config,
)
from tokenbudget.server.engine.disagg.decode import DecodeConnector
from tokenbudget.server.engine.disagg.prefill import PrefillConnector

__all__ = [
    "DecodeConnector",
    "DisaggregationConfig",
    "PrefillConnector",
    "check_disaggregation",
    "parse_kv_transfer_config",
]
