"""A checkpoint that cannot be read: `server` prints one line naming the path
or id, how it was read and what to do, and exits 2 without a traceback;
LLM(...) raises a ValueError with the same line. Nothing reaches the network
(HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tokenbudget.server import LLM
from tokenbudget.core.utils.model_source import ModelLoadError

from .conftest import BIN

NO_DIR = (
    "cannot load model './no-such-dir': no such local folder, and not a valid Hugging "
    "Face hub id (org/name) either; check the path given to --model"
)
OFFLINE = (
    "cannot load model 'nosuchorg/nosuchmodel': there is no local folder of that name, "
    "so it was read as a Hugging Face hub id, which is not in the local cache, and "
    "HF_HUB_OFFLINE=1 forbids downloading it; point --model to a local folder, or "
    "download it while online"
)
EMPTY = "read as a local folder, but it holds no config.json"


def test_server_says_what_it_looked_for_and_exits_2(tmp_path, tiny_model):
    cases = {
        "./no-such-dir": NO_DIR,
        "nosuchorg/nosuchmodel": OFFLINE,
        str(tmp_path): f"cannot load model {str(tmp_path)!r}: {EMPTY}",
    }
    argv = {model: ["--model", model] for model in cases}
    argv["tokenizer"] = ["--model", tiny_model, "--tokenizer", "nosuchorg/nosuchtokenizer"]
    cases["tokenizer"] = "cannot load tokenizer 'nosuchorg/nosuchtokenizer': there is no local"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # Started together: each spends most of its time importing torch.
    procs = {
        name: subprocess.Popen(
            [str(BIN / "server"), *args, "--port", "0"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in argv.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, (name, out, err)
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("server: ") and cases[name] in lines[0], err


def test_llm_raises_the_same_line(tmp_path):
    # (A hub id is left to the server test: in this process huggingface_hub
    # read HF_HUB_OFFLINE at import, so it would try the network.)
    with pytest.raises(ModelLoadError) as err:
        LLM("./no-such-dir")
    assert str(err.value) == NO_DIR and isinstance(err.value, ValueError)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path))
    assert str(err.value).startswith(
        f"cannot load model {str(tmp_path)!r}: {EMPTY} (point "
        "--model to a folder saved with save_pretrained"
    )
