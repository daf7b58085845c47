"""The Llama model every chapter trains, and the FLOPs it computes per token: RMSNorm
before each block, rotary embeddings (rotate-half), grouped-query attention through
`F.scaled_dot_product_attention`, SwiGLU MLP, untied head; Llama's parameter names."""

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
            raise ValueError(f"num_attention_heads={self.num_attention_heads} does not divide hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")

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
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048), }


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
    """Whether attention passes grouped K/V heads to SDPA as they are (enable_gqa). On
    CUDA only the flash kernel takes them, with no mask and no fp32; otherwise the math
    kernel would keep every B x H x T x T score. The CPU's fused kernel takes all."""
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
        y = self.attend(q, k, v, attn_mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q, k, v, attn_mask=None):
        """Causal attention of q (B, heads, T, head_dim) over k and v (B, KV heads, T,
        head_dim), the whole sequence in this process. (Chapter 08 sets another function
        here, per layer: attention over a sequence split across processes.)"""
        # padded data brings an additive mask (masks.py); packed data none: is_causal then
        # takes a fused kernel's causal path
        mask = None if attn_mask is None else attn_mask.to(q.dtype)
        # Grouped-query attention: each KV head serves n_heads / n_kv_heads query heads.
        gqa = k.shape[1] != q.shape[1]
        if gqa and not shares_kv_heads(q.device.type, q.dtype, masked=mask is not None):
            # repeated per query head, K and V suit the memory-efficient kernel
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


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


@torch.no_grad()
def init_parameter(name: str, p: torch.Tensor, num_layers: int) -> None:
    """GPT-2 style: N(0, 0.02); the projections into the residual stream (o_proj,
    down_proj) scaled by 1/sqrt(2 * layers), so its variance does not grow with depth;
    the RMSNorm weights ones. Drawn from the global generator, in the caller's order."""
    std = 0.02
    if p.dim() == 1:
        nn.init.ones_(p)  # RMSNorm weights
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * num_layers))
    else:
        nn.init.normal_(p, mean=0.0, std=std)


class LlamaForCausalLM(nn.Module):
    """`activation_checkpointing`: keep only each layer's input and run its forward again
    in backward: the same gradients, far less activation memory."""

    def __init__(self, config: LlamaConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for name, p in self.named_parameters():
            init_parameter(name, p, self.config.num_hidden_layers)

    def forward(self, input_ids, attn_mask=None, last_only: bool = False):
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
        # fp32 logits for the loss (fp64 stays fp64) whatever autocast does; last_only: sampling
        logits = self.lm_head(self.norm(x[:, -1:] if last_only else x))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None, eos_id: int | None = None):
        """Plain sampling, no KV cache: enough for a sample at the end of training."""
        for _ in range(max_new_tokens):
            ctx = input_ids[:, -self.config.max_position_embeddings:]
            logits = self(ctx, last_only=True)[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            input_ids = torch.cat([input_ids, nxt], dim=1)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
        return input_ids


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def non_matmul_params(config: LlamaConfig) -> int:
    """Parameters in no matrix multiply: the embedding table and the RMSNorm gains."""
    h = config.hidden_size
    return config.vocab_size * h + (2 * config.num_hidden_layers + 1) * h


def flops_per_token(config: LlamaConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward; not the
    embedding nor the norm gains), plus attention's full T×T scores as PaLM counts them."""
    return 6 * (num_params - non_matmul_params(config)) + attention_flops_per_token(config, seq_len)


def attention_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """12·L·H·Q·T: scores and values, forward and backward (L layers, H heads, Q head dim)."""
    return 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len


def describe(config: LlamaConfig) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.to_dict().items())
