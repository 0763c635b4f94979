"""Tiny, randomly initialised checkpoints built locally (tests, demos, benchmarks).

Everything here is deterministic and offline: a byte-level BPE tokenizer is
trained on a small built-in corpus with the Qwen special tokens, and a tiny
decoder (Qwen3, or GPT-2, Llama, Mistral, ... with that tokenizer) is
random-initialised from a fixed seed and saved with ``save_pretrained`` so it
is loaded through the real loading code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen-style ChatML. A content may be a string or a list of parts; an image part
# becomes one <|image_pad|> that the multimodal processor later expands to the
# image's number of embeddings.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Language models predict the next token from the tokens before it. Attention lets every position look
at the positions that came earlier; a key-value cache keeps what was computed so it is not repeated.
The scheduler hands out a budget of tokens each step: prompts are split into chunks, and requests that
are decoding get one token each. When memory runs short, a request is preempted and recomputed later.
Paged attention stores keys and values in fixed-size blocks, and a block table maps a sequence to them.
Prefix caching finds blocks by the hash of their tokens so shared system prompts are computed once.
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
{"name": "tokenbudget", "version": 1, "tags": ["serving", "inference"], "ok": true, "value": null}
SELECT id, name FROM users WHERE age >= 18 ORDER BY name LIMIT 10;
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 -7 1e-5
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is.
Describe the image. The picture shows a cat sitting on a red chair next to a window at sunset.
Unicode: café naïve résumé Straße 東京 こんにちは 你好 世界 🙂 🚀 ✓ — “quotes” ‘single’
User: write a haiku about the sea. Assistant: waves fold into foam / the tide keeps its patient time
/ salt on the cold wind.
"""


def _training_lines() -> list[str]:
    """The corpus plus seeded pseudo-words, so the BPE learns ~1k merges."""
    import random

    rng = random.Random(0)
    syllables = [
        "ka",
        "to",
        "ri",
        "en",
        "mo",
        "sha",
        "lu",
        "pe",
        "qui",
        "dro",
        "an",
        "ist",
        "ver",
        "ble",
        "tion",
        "ing",
        "ou",
        "ze",
        "ph",
        "gra",
    ]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]
    return _CORPUS.splitlines() * 4 + lines


def build_tokenizer(path: str | os.PathLike, *, vocab_size: int = 1200):
    """Train a byte-level BPE with the Qwen special tokens and save it into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_lines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    Path(path).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def padded_vocab_size(num_tokens: int, multiple: int = 64) -> int:
    return -(-num_tokens // multiple) * multiple


# Tiny settings per architecture (hidden 64, 2 layers), in each config's own
# names: GPT-2's old ones, a Mistral sliding window as wide as its context
# (exactly full attention), Gemma's single KV head, Phi's partial rotary.
_TINY_DECODERS = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            max_position_embeddings=4096,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=4096,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=1024),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=4096,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            max_position_embeddings=4096,
            sliding_window=4096,
        ),
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            partial_rotary_factor=0.5,
            max_position_embeddings=4096,
        ),
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=128,
            max_position_embeddings=4096,
        ),
    ),
}
TINY_ARCHITECTURES = tuple(_TINY_DECODERS)


def build_tiny_decoder(
    path: str | os.PathLike,
    architecture: str,
    *,
    seed: int = 0,
    generation_config: dict | None = None,
    **overrides,
) -> str:
    """Save a random-init tiny decoder of ``architecture`` (one of
    TINY_ARCHITECTURES; float32) and the shared tokenizer into ``path``.
    ``generation_config`` adds fields to its generation_config.json (sampling
    defaults); ``overrides`` change the model config."""
    import torch
    import transformers

    config_name, model_name, settings = _TINY_DECODERS[architecture]
    tokenizer = build_tokenizer(path)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    settings = dict(
        settings,
        vocab_size=padded_vocab_size(len(tokenizer)),
        tie_word_embeddings=architecture == "gpt2",
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    settings.update(overrides)
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=pad_id, bos_token_id=None
    )
    model.save_pretrained(str(path))
    if generation_config:
        # Written as given: transformers refuses to save sampling fields
        # without do_sample, yet published checkpoints' files hold them.
        file = Path(path) / "generation_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **generation_config}, indent=2))
    return str(path)


def build_tiny_qwen3(path: str | os.PathLike, *, seed: int = 0, **overrides) -> str:
    """Save a random-init tiny Qwen3ForCausalLM (float32) and its tokenizer into ``path``."""
    return build_tiny_decoder(path, "qwen3", seed=seed, **overrides)


def add_sentence_transformers_files(path: str | os.PathLike, mode: str, normalize: bool) -> None:
    """Make the checkpoint in ``path`` a sentence-transformers embedding model:
    ``modules.json`` naming a Pooling module (``mode``: "lasttoken", "mean" or
    "cls") and, with ``normalize``, a Normalize module."""
    folder = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_cls_token": mode == "cls",
                "pooling_mode_mean_tokens": mode == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_lasttoken": mode == "lasttoken",
            }
        )
    )
