"""Hardware and model profiles for the cost model: plain data.

Hardware figures are vendor datasheet figures (dense bf16 tensor-core peak,
HBM bandwidth, memory size), not measurements. Model shapes are the published
configs (config.json) of the Qwen3 checkpoints. ``ModelProfile.from_hf_config``
builds a profile for any decoder from its config, so users can add their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float  # device memory


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], name: str | None = None, dtype_bytes: int = 2
    ) -> ModelProfile:
        """From a Hugging Face decoder config (a dict of config.json)."""
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            name=name or config.get("_name_or_path") or config.get("model_type", "model"),
            num_layers=config["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_params(self) -> int:
        """Weights of the transformer layers (attention and MLP projections)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return self.num_layers * (attn + mlp)

    @property
    def weight_bytes(self) -> int:
        """Bytes read per step: every layer and the LM head once (the input
        embedding only reads the rows it looks up)."""
        return (self.layer_params + self.vocab_size * self.hidden_size) * self.dtype_bytes

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.layer_params + embed * (1 if self.tie_word_embeddings else 2)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CostConstants:
    """What the roofline leaves out. Effective rates are ``efficiency x peak``;
    overheads are host time per step, per scheduled request, per prompt chunk
    (a request computing more than one token) and per token."""

    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.0
    per_request_s: float = 0.0
    per_token_s: float = 0.0
    per_prefill_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def with_(self, **changes: float) -> CostConstants:
        return replace(self, **changes)


# Constants for the GPU profiles. The efficiencies are assumptions (typical
# dense-GEMM and streaming fractions of peak), not fits: no GPU recording has
# been fitted yet. The step overhead is the host time per step fitted on the
# CPU recording (tests/simulator/data), which a GPU step pays as well; the
# CPU's per-request term is its attention loop, which a GPU kernel does not
# pay, so it is left out.
GPU_DEFAULT_CONSTANTS = CostConstants(
    compute_efficiency=0.6, memory_efficiency=0.8, step_overhead_s=0.0016
)

HARDWARE: dict[str, HardwareProfile] = {
    # NVIDIA datasheet figures: H100 SXM 80 GB, H200 SXM 141 GB, A100 SXM 80 GB.
    "h100": HardwareProfile("h100", 989e12, 3.35e12, 80e9),
    "h200": HardwareProfile("h200", 989e12, 4.8e12, 141e9),
    "a100": HardwareProfile("a100", 312e12, 2.0e12, 80e9),
}

# The published shapes of the Qwen3 checkpoints (their config.json).
MODELS: dict[str, ModelProfile] = {
    "qwen3-0.6b": ModelProfile(
        "qwen3-0.6b",
        num_layers=28,
        hidden_size=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": ModelProfile(
        "qwen3-8b",
        num_layers=36,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
    ),
    "qwen3-32b": ModelProfile(
        "qwen3-32b",
        num_layers=64,
        hidden_size=5120,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=25600,
        vocab_size=151936,
    ),
}


def get_hardware(name: str) -> HardwareProfile:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None


def get_model(name: str) -> ModelProfile:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
