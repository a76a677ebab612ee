"""Model configuration: the Hugging Face `config.json` fields the Llama family needs.

`ModelConfig.from_hf(dict)` accepts Llama 2/3, Qwen2, Qwen3 (dense), Qwen3-MoE and Mistral configs; presets give
random-initialised models of real shapes (no downloads are possible on our machines). The mixture-of-experts
fields (num_experts ...) carry Hugging Face's Qwen3MoeConfig names and act only for model_type qwen3_moe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
_HF_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "mistral": "Mistral"}
# Qwen3MoeConfig's expert fields (config.json names); written to config.json only for qwen3_moe
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "router_aux_loss_coef")


class ModelConfigError(ValueError):
    """A model config or checkpoint that does not fit this implementation."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool | None = None  # bias on q/k/v (not o); None -> True for Qwen2, else False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    num_labels: int = 1  # score head width for reward / critic models
    # mixture of experts (qwen3_moe): experts per MoE layer, experts each token goes to, each expert's MLP width,
    # whether the top-k probabilities are renormalised to sum to 1, every decoder_sparse_step-th layer is MoE
    # except mlp_only_layers (dense MLPs of intermediate_size), the load-balancing loss's weight in training
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # unknown HF keys, round-tripped

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"
        self.validate()

    def validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads({self.num_key_value_heads})"
            )
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ModelConfigError("Qwen2 always has q/k/v biases; attention_bias=False is not a Qwen2 model")
        if self.model_type == "qwen3" and self.attention_bias:
            # Qwen3's attention_bias also puts a bias on o_proj, which this implementation has not got
            raise ModelConfigError("Qwen3 attention_bias=true is not supported (no published Qwen3 uses it); "
                                   "set attention_bias to false in config.json")
        if self.model_type == "qwen3_moe":
            self._validate_moe()
        elif self.num_experts:
            raise ModelConfigError(f"num_experts={self.num_experts} needs model_type qwen3_moe "
                                   f"(got {self.model_type!r})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim({self.head_dim}) must be even for rotary embeddings")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ModelConfigError(
                    f"rope_scaling type {kind!r} is not supported (supported: llama3, default)"
                )

    def _validate_moe(self) -> None:
        if self.attention_bias:
            raise ModelConfigError("Qwen3-MoE attention_bias=true is not supported; set it to false in config.json")
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"qwen3_moe needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts "
                                   f"(got {self.num_experts} and {self.num_experts_per_tok})")
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ModelConfigError(f"qwen3_moe needs moe_intermediate_size >= 1 and decoder_sparse_step >= 1 (got "
                                   f"{self.moe_intermediate_size} and {self.decoder_sparse_step})")

    @property
    def qk_norm(self) -> bool:
        """Whether each attention head's q and k pass an RMSNorm over head_dim before RoPE (Qwen3, Qwen3-MoE)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe" and bool(self.moe_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Hugging Face's rule: a sparse MoE block every decoder_sparse_step-th layer, except mlp_only_layers."""
        return (self.model_type == "qwen3_moe" and self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count of the causal LM (no value/score head), every expert included."""
        return self._count(include_embedding=include_embedding, experts=self.num_experts)

    def expert_params(self) -> int:
        """Parameters of the stacked expert tensors (every MoE layer's experts; the routers not included)."""
        return len(self.moe_layers) * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def _count(self, *, include_embedding: bool, experts: int) -> int:
        """Parameters with `experts` experts per MoE layer (all of them, or the top-k a token uses)."""
        h, d = self.hidden_size, self.head_dim
        q = h * self.num_attention_heads * d
        kv = 2 * h * self.num_key_value_heads * d
        o = self.num_attention_heads * d * h
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * d if self.attention_bias else 0
        attn = q + kv + o + bias + 2 * h + (2 * d if self.qk_norm else 0)
        moe = len(self.moe_layers)
        dense_mlp = 3 * h * self.intermediate_size
        sparse_mlp = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h  # + the router
        total = self.num_hidden_layers * attn + (self.num_hidden_layers - moe) * dense_mlp + moe * sparse_mlp + h
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def matmul_params(self, *, lm_head: bool = True) -> int:
        """Parameters that cost 2 FLOP per token in a forward: everything but the input embedding
        lookup. The N of the FLOP accounting. lm_head: the policy's vocabulary projection is a matmul,
        tied or not; a critic or reward model has a scalar head instead (lm_head=False). A mixture of experts
        counts the experts a token runs through (num_experts_per_tok) and the router: its active parameters."""
        body = self._count(include_embedding=False, experts=self.num_experts_per_tok)
        return body + (self.vocab_size * self.hidden_size if lm_head else 0)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or
        5.x `rope_parameters`); features we do not implement are rejected with the fix to apply."""
        model_type = d.get("model_type", "llama")
        _reject_unsupported(model_type, d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "attention_bias", "model_type"}
        kwargs = {k: d[k] for k in names if k in d}
        if model_type != "qwen3_moe":
            kwargs = {k: v for k, v in kwargs.items() if k not in MOE_FIELDS}
        elif "num_experts" not in d and "num_local_experts" in d:  # transformers 5 writes this name
            kwargs["num_experts"] = d["num_local_experts"]
        kwargs["model_type"] = model_type
        kwargs["attention_bias"] = bool(d.get("attention_bias", model_type == "qwen2"))
        if d.get("num_key_value_heads") is None:  # HF: absent means multi-head attention
            kwargs.pop("num_key_value_heads", None)
            if "num_attention_heads" in d:
                kwargs["num_key_value_heads"] = d["num_attention_heads"]
        kwargs["rope_theta"], kwargs["rope_scaling"] = _rope_from_hf(d)
        if d.get("num_labels") is None and "id2label" in d:
            kwargs["num_labels"] = len(d["id2label"])
        kwargs["extra"] = {k: v for k, v in d.items() if k not in names and k not in _DERIVED_KEYS
                           and not (model_type == "qwen3_moe" and k in _MOE_DERIVED_KEYS)}
        return cls(**kwargs)

    def to_hf(self, *, architecture: str = "ForCausalLM") -> dict[str, Any]:
        """config.json dict; `architecture` is the class suffix (`ForCausalLM`, `ForSequenceClassification`).
        RoPE is written both ways (`rope_parameters` for transformers 5, `rope_theta`/`rope_scaling` for 4)."""
        prefix = _HF_PREFIX[self.model_type]
        d: dict[str, Any] = {k: v for k, v in self.extra.items() if k not in _DERIVED_KEYS}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "num_labels") or (f.name in MOE_FIELDS and self.model_type != "qwen3_moe"):
                continue
            d[f.name] = getattr(self, f.name)
        d["rope_parameters"] = {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}
        if self.model_type == "qwen2":
            d.pop("attention_bias")  # Qwen2 always has q/k/v bias; its config has no such key
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
            d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        if self.model_type == "mistral":
            d["sliding_window"] = None
        d["architectures"] = [prefix + architecture]
        if architecture == "ForSequenceClassification":
            d["num_labels"] = self.num_labels
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return d


# keys regenerated by to_hf from typed fields (never round-tripped through `extra`)
_DERIVED_KEYS = frozenset({"model_type", "attention_bias", "architectures", "torch_dtype", "dtype", "rope_parameters",
                           "rope_theta", "rope_scaling", "id2label", "label2id", "num_labels", "layer_types",
                           "use_sliding_window", "sliding_window", "transformers_version"})
_MOE_DERIVED_KEYS = frozenset({"num_local_experts", "output_router_logits"})


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config generation; rope_parameters wins."""
    params = d.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    return float(theta), scaling


def _reject_unsupported(model_type: str, d: dict[str, Any]) -> None:
    if model_type == "mistral" and d.get("sliding_window") not in (None, 0):
        max_pos = d.get("max_position_embeddings", 0)
        if d["sliding_window"] < max_pos:
            raise ModelConfigError(
                f"Mistral sliding_window={d['sliding_window']} < max_position_embeddings={max_pos}: "
                "sliding-window attention is not supported; set sliding_window to null in config.json "
                "(exact for sequences shorter than the window)"
            )
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and d.get("use_sliding_window", False):
        raise ModelConfigError(f"{_HF_PREFIX[model_type]} use_sliding_window=true is not supported; "
                               "set it to false in config.json")
    # Qwen2/3 with use_sliding_window=false attend fully whatever layer_types says (sliding_window -> None)
    if model_type not in ("qwen2", "qwen3", "qwen3_moe"):
        bad_layers = [i for i, t in enumerate(d.get("layer_types") or []) if t != "full_attention"]
        if bad_layers:
            raise ModelConfigError(
                f"layer_types marks layers {bad_layers[:8]} as {d['layer_types'][bad_layers[0]]!r}; only "
                "full_attention is supported"
            )
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={d['hidden_act']!r} is not supported (only silu)")
    if d.get("mlp_bias", False):
        raise ModelConfigError("mlp_bias=true is not supported (Llama-family MLPs here have no bias)")

PRESETS: dict[str, dict[str, Any]] = {
    # tests and the CPU demo: 4 heads / 2 KV heads so TP=2 and GQA are both exercised
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # tiny with head_dim 32 (q/k/v project 64 -> 4 x 32): vLLM's CPU attention needs head_dim >= 32
    "tiny-hd32": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # the tiny body as a Qwen3 (CPU recipes and tests): per-head q/k norms, head_dim 32 with 4 heads of a 64-wide
    # model (num_heads * head_dim != hidden_size, as in Qwen3-0.6B), tied embeddings
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # a tiny Qwen3-MoE (tests and the CPU demo): 8 experts, top-2, renormalised; layer 0 dense (mlp_only_layers)
    # so both MLP kinds run
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=176,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                           mlp_only_layers=[0], router_aux_loss_coef=0.001),
    # Qwen3-30B-A3B from its published config.json (128 experts, top-8 renormalised, 48 layers, all MoE)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          router_aux_loss_coef=0.001),
    # Llama-3.2-1B-like body with a Llama-2 vocabulary (the shape the benchmarks are specified on)
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                     rope_theta=500000.0),
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                     rope_theta=10000.0),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
    # Qwen3 dense models, from their published config.json: q/k RMSNorm per head, head_dim 128 whatever
    # hidden_size / heads is (0.6B: 16 x 128 = 2048 != 1024), tied embeddings up to 4B
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-14b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                      num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
}


# Qwen3-30B-A3B's widths, experts and top-k cut to 6 of its 48 layers (4.4B parameters, 0.8B active): what trains
# on one H200 beside its reference and rollout (18 bytes a parameter at dp = 1: bf16 weights, fp32 main grads,
# fp32 masters, Adam's moments); the one-GPU benchmark's model (conf/bench_grpo_moe.yaml)
PRESETS["qwen3-30b-a3b-6l"] = {**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": 6}


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return ModelConfig(**{**PRESETS[name], **overrides})
