"""The Llama model every chapter trains, and the FLOPs it computes per token.

Standard Llama architecture: RMSNorm before each block, rotary position embeddings
(rotate-half convention), grouped-query attention through
`F.scaled_dot_product_attention`, SwiGLU MLP, untied LM head. Parameter names map
one-to-one onto the usual Llama state-dict layout (`embed_tokens`,
`layers.N.self_attn.q_proj`, ..., `norm`, `lm_head`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class LlamaConfig:
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 3
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("vocab_size", "max_position_embeddings", "hidden_size",
                     "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes. `vocab_size` is a placeholder: the tokenizer decides it (get_config).
PRESETS: dict[str, dict] = {
    # trains in seconds on a CPU; for tests
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # a few million parameters; CPU demos
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512),
    # GPT-2-small class
    "base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=3, max_position_embeddings=2048),
    # GPT-2-medium class
    "medium": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
    # about one billion parameters (TinyLlama-like shape)
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
}


def get_config(preset: str, vocab_size: int, **overrides) -> LlamaConfig:
    """The named preset with the tokenizer's vocabulary size."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return LlamaConfig(vocab_size=vocab_size, **{**PRESETS[preset], **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) * weight, normalised in fp32 (as Llama does), then
        # cast back; F.rms_norm is that arithmetic, fused on CUDA
        if x.dtype != torch.float32:
            return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        y = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # the fp32 residual stream
        if torch.is_autocast_enabled(x.device.type):
            # under autocast each of the five matmuls reading y would cast it to bf16:
            # once here instead (the same values; fewer kernels, bf16 kept for backward)
            y = y.to(torch.get_autocast_dtype(x.device.type))
        return y


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, cached as non-persistent buffers (not saved)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)               # (T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)        # rotate-half layout: (T, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, seq_len: int):
        return self.cos[:seq_len], self.sin[:seq_len]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """x: (B, heads, T, head_dim); cos/sin: (T, head_dim)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


def shares_kv_heads(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether attention passes its grouped K/V heads to SDPA as they are (enable_gqa).
    On CUDA only the flash kernel takes grouped heads, and it takes no mask and no fp32:
    there a mask or fp32 would fall back to the math kernel, which keeps every B x H x T
    x T score, so K and V are repeated per query head for the memory-efficient kernel.
    On the CPU the fused kernel takes grouped heads, masks and fp32 alike."""
    if device_type != "cuda":
        return True
    return not masked and dtype in (torch.float16, torch.bfloat16)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, kv = config.hidden_size, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin, attn_mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Padded data brings an additive mask (causal + padding keys, see masks.py); packed
        # data none: is_causal then takes a fused kernel's causal path (flash in bf16 on CUDA,
        # the memory-efficient kernel in fp32 on CUDA, the fused C++ kernel on the CPU).
        mask = None if attn_mask is None else attn_mask.to(q.dtype)
        # Grouped-query attention: each KV head serves n_heads / n_kv_heads query heads.
        gqa = self.n_kv_heads != self.n_heads
        if gqa and not shares_kv_heads(q.device.type, q.dtype, masked=mask is not None):
            # repeated per query head, K and V suit the memory-efficient kernel (B x H x T x
            # head_dim more memory, not the B x H x T x T scores of the math fallback)
            groups = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """`activation_checkpointing`: keep only each decoder layer's input for backward and
    run the layer's forward again there (torch.utils.checkpoint): the same gradients,
    one more forward of the layers, far less activation memory."""

    def __init__(self, config: LlamaConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # GPT-2 style: N(0, 0.02); the projections into the residual stream (o_proj,
        # down_proj) scaled by 1/sqrt(2 * layers), so its variance does not grow with depth
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)  # RMSNorm weights
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, input_ids, attn_mask=None):
        T = input_ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        cos, sin = self.rotary(T)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # non-reentrant: works with DDP, torch.compile and inputs that need no grad
                x = checkpoint(layer, x, cos, sin, attn_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn_mask)
        # fp32 logits (fp64 stays fp64), whatever autocast does: the loss's log-softmax then
        # runs in fp32 on every device (CUDA's autocast would run it on the bf16 logits).
        logits = self.lm_head(self.norm(x))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None,
                 eos_id: int | None = None):
        """Plain sampling, no KV cache: enough for a sample at the end of training."""
        for _ in range(max_new_tokens):
            ctx = input_ids[:, -self.config.max_position_embeddings:]
            logits = self(ctx)[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            input_ids = torch.cat([input_ids, nxt], dim=1)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
        return input_ids


def num_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        n -= model.embed_tokens.weight.numel()
    return n


def non_matmul_params(config: LlamaConfig) -> int:
    """Parameters in no matrix multiply: the embedding table and the RMSNorm gains."""
    h = config.hidden_size
    return config.vocab_size * h + (2 * config.num_hidden_layers + 1) * h


def flops_per_token(config: LlamaConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token (`num_params`: the model's full count). Each weight that
    multiplies an activation costs 2 FLOPs forward and 4 backward: 6 per matmul weight,
    `lm_head` included, the embedding lookup and norm gains not. Attention adds
    12·L·H·Q·T (scores and values, forward and backward; L layers, H query heads, Q head
    dim, T sequence), counting the full T×T scores as PaLM and nanoGPT do."""
    return 6 * (num_params - non_matmul_params(config)) + attention_flops_per_token(config, seq_len)


def attention_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """`flops_per_token`'s attention term: 12·L·H·Q·T (scores and values, for training)."""
    return 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len


def describe(config: LlamaConfig) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.to_dict().items())
