"""The opt-in xxhash block hash is seeded, so nobody can precompute prompts
whose blocks collide: at random per process, or from hash_seed; sha256 (the
default) takes no seed (issue 10, defect 4)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from array import array

import pytest

from tokenbudget.core import Request, SamplingParams
from tokenbudget.core.kv.hashing import BlockHasher

PROMPT = list(range(3, 35))
needs_xxhash = pytest.mark.skipif(
    importlib.util.find_spec("xxhash") is None,
    reason="xxhash is an optional extra (tokenbudget[fast-hash])",
)


def _hashes(algo: str, seed: int | None = None) -> list[bytes]:
    return BlockHasher(16, algo, seed).update(Request("r", PROMPT, SamplingParams()))


@needs_xxhash
def test_xxhash_is_seeded_from_hash_seed_or_at_random_per_process():
    import xxhash

    unseeded = xxhash.xxh3_128_digest(array("q", PROMPT[:16]).tobytes())
    default = _hashes("xxhash")
    assert default[0] != unseeded  # not the well-known seed 0
    assert _hashes("xxhash") == default  # one seed for the whole process
    assert _hashes("xxhash", 5)[0] == xxhash.xxh3_128_digest(array("q", PROMPT[:16]).tobytes(), 5)
    assert _hashes("xxhash", 5) != _hashes("xxhash", 6)
    # Another process draws another seed.
    code = "from tokenbudget.core.kv import hashing; print(hashing._PROCESS_SEED)"
    seeds = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(seeds) == 2


def test_sha256_is_unseeded_and_unchanged():
    import hashlib

    first = hashlib.sha256(array("q", PROMPT[:16]).tobytes()).digest()
    assert (
        _hashes("sha256")
        == _hashes("sha256", 5)
        == [first, hashlib.sha256(first + array("q", PROMPT[16:]).tobytes()).digest()]
    )


def test_xxhash_without_the_package_is_refused_when_the_arguments_are_checked(monkeypatch):
    from tokenbudget.server.engine.args import EngineArgs
    from tokenbudget.server.entrypoints.llm import LLM

    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'tokenbudget\[fast-hash\]'"):
        EngineArgs.from_kwargs("m", hash_algo="xxhash")
    # Before anything loads: the model path is never looked at.
    with pytest.raises(ValueError, match="hash_algo='xxhash' needs the xxhash package"):
        LLM("/no/such/model", hash_algo="xxhash")
