"""The model is the standard Llama function: names, shapes, init, and the same logits
as an independent float64 reference written here from the state dict."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from common.data import train_tokenizer
from common.masks import build_attention_mask
from common.model import (PRESETS, LlamaConfig, LlamaForCausalLM, RMSNorm, RotaryEmbedding,
                          shares_kv_heads, apply_rotary, flops_per_token, get_config, non_matmul_params,
                          num_parameters)

VOCAB = 97


def make_model(vocab: int = VOCAB, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(get_config("tiny", vocab, **overrides)).eval()


def spread_weights(model: LlamaForCausalLM, seed: int = 1) -> LlamaForCausalLM:
    """Weights large enough that attention is far from uniform and norm weights far
    from one, so a wrong detail (RoPE convention, head grouping, norm) shows in logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model


# ------------------------------------------------------------------ config, presets

EXPECTED_PRESETS = {  # hidden, intermediate, layers, heads, kv heads, positions
    "tiny": (64, 176, 2, 4, 2, 256),
    "small": (256, 688, 4, 8, 2, 512),
    "base": (768, 3072, 12, 12, 3, 2048),
    "medium": (1024, 4096, 24, 16, 4, 2048),
    "large": (2048, 5632, 22, 32, 4, 2048),
}


def test_config_uses_standard_llama_field_names():
    names = {f.name for f in dataclasses.fields(LlamaConfig)}
    assert names == {"vocab_size", "max_position_embeddings", "hidden_size",
                     "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "rope_theta", "rms_norm_eps"}


@pytest.mark.parametrize("preset", list(EXPECTED_PRESETS))
def test_preset_shapes(preset):
    cfg = get_config(preset, vocab_size=1234)
    got = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
           cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings)
    assert got == EXPECTED_PRESETS[preset]
    assert cfg.vocab_size == 1234  # the tokenizer decides the vocabulary, not the preset
    assert cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size


def test_presets_listed_are_exactly_the_documented_ones():
    assert set(PRESETS) == set(EXPECTED_PRESETS)
    with pytest.raises(ValueError, match="huge"):
        get_config("huge", 100)


def test_vocabulary_comes_from_the_tokenizer():
    tok = train_tokenizer(["def f(x):\n    return x + 1\n"] * 4, vocab_size=270)
    model = LlamaForCausalLM(get_config("tiny", tok.get_vocab_size()))
    assert model.embed_tokens.num_embeddings == model.lm_head.out_features == tok.get_vocab_size()
    ids = torch.tensor([tok.encode("return x").ids])
    assert model(ids).shape[-1] == tok.get_vocab_size()


def test_overrides_apply():
    cfg = get_config("tiny", 50, num_hidden_layers=3, max_position_embeddings=32)
    assert (cfg.num_hidden_layers, cfg.max_position_embeddings, cfg.hidden_size) == (3, 32, 64)


# ---------------------------------------------------------------- state-dict layout

def expected_state_dict_shapes(cfg: LlamaConfig) -> dict[str, tuple]:
    h, i, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = {"embed_tokens.weight": (V, h), "norm.weight": (h,), "lm_head.weight": (V, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def test_state_dict_is_the_llama_layout():
    model = make_model()
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # exact: nothing missing, nothing extra (rotary cos/sin are non-persistent buffers)
    assert got == expected_state_dict_shapes(model.config)
    assert any("rotary" in name for name, _ in model.named_buffers())


def test_logits_shape():
    model = make_model()
    ids = torch.randint(0, VOCAB, (3, 11))
    assert model(ids).shape == (3, 11, VOCAB)


def test_sampling_reads_the_last_positions_logits_computed_alone():
    """last_only (what generate asks for) projects only the last position onto the
    vocabulary: the logits the full forward gives there (to rounding: one row against a
    matrix of them); generate extends the prompt with what it draws from them."""
    model = make_model().eval()
    ids = torch.randint(0, VOCAB, (3, 11))
    with torch.no_grad():
        last, full = model(ids, last_only=True), model(ids)
    assert last.shape == (3, 1, VOCAB)
    torch.testing.assert_close(last[:, -1], full[:, -1])
    out = model.generate(ids[:1], 6, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 11 + 6) and torch.equal(out[:, :11], ids[:1])


# --------------------------------------------------- the same function as Llama

def reference_llama(sd: dict, cfg: LlamaConfig, ids: torch.Tensor) -> torch.Tensor:
    """Naive float64 Llama written from the architecture's definition, independent of
    common.model: explicit RMSNorm, rotate-half RoPE from scratch, repeated KV heads,
    softmax attention with an explicit causal mask, SwiGLU."""
    sd = {k: v.double() for k, v in sd.items()}
    B, T = ids.shape
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H

    def rmsnorm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    # RoPE, rotate-half convention: dimension j pairs with j + D/2, frequency theta^(-2j/D)
    j = torch.arange(D // 2, dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * cfg.rope_theta ** (-2 * j / D)
    cos, sin = torch.cos(angle), torch.sin(angle)          # (T, D/2)

    def rope(x):                                           # (B, heads, T, D)
        a, b = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def heads(x, n):
        return x.view(B, T, n, D).transpose(1, 2)

    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = sd["embed_tokens.weight"][ids]
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        h = rmsnorm(x, sd[p + "input_layernorm.weight"])
        q = rope(heads(h @ sd[p + "self_attn.q_proj.weight"].T, H))
        k = rope(heads(h @ sd[p + "self_attn.k_proj.weight"].T, KV))
        v = heads(h @ sd[p + "self_attn.v_proj.weight"].T, KV)
        # KV head g serves query heads g*rep ... g*rep + rep - 1
        rep = H // KV
        k = torch.stack([k[:, qh // rep] for qh in range(H)], dim=1)
        v = torch.stack([v[:, qh // rep] for qh in range(H)], dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.exp(scores - scores.amax(-1, keepdim=True))
        att = att / att.sum(-1, keepdim=True)
        y = (att @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + y @ sd[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, sd[p + "post_attention_layernorm.weight"])
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        up = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rmsnorm(x, sd["norm.weight"]) @ sd["lm_head.weight"].T


def test_logits_equal_independent_llama_reference():
    model = spread_weights(make_model(num_hidden_layers=3))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    want = reference_llama(model.state_dict(), model.config, ids)
    with torch.no_grad():
        got = model.double()(ids)
    assert got.dtype == torch.float64
    assert want.abs().max() > 1.0  # logits are not trivially small
    # (tolerance: the model's cos/sin tables are computed in float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_the_explicit_formula_bit_for_bit_on_a_cpu(dtype):
    """RMSNorm calls F.rms_norm (fused kernels on CUDA); on a CPU it must be
    x * rsqrt(mean(x^2) + eps) in fp32, cast back, times the weight, to the last bit,
    forward and backward, so that no CPU figure of the guide moves."""
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 7, 48).to(dtype).requires_grad_()
    grad = torch.randn(3, 7, 48)

    def explicit(x):
        h = x.float()
        return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    got, want = norm(x), explicit(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, norm.weight), grad),
                    torch.autograd.grad(want, (x, norm.weight), grad)):
        assert torch.equal(a, b)


def test_under_autocast_rmsnorm_hands_the_matmuls_what_they_would_cast_to_themselves():
    """Under autocast the fp32 residual stream's norm comes out in the autocast dtype:
    exactly the fp32 result cast, which each of the next layer's matmuls would otherwise
    cast separately; outside autocast it stays fp32."""
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 7, 48)
    plain = norm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = norm(x)
        linear = torch.nn.Linear(48, 16, bias=False)
        same = torch.equal(linear(cast), linear(plain))
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
    assert torch.equal(cast, plain.to(torch.bfloat16)) and same


def test_the_logits_are_fp32_under_autocast_so_the_loss_is_computed_in_fp32():
    """The head's matmul runs in bf16 under autocast, but the model hands back fp32
    logits (the bf16 result, cast): a loss on them takes its log-softmax in fp32 on every
    device, where CUDA's autocast would take it on the bf16 logits."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(get_config("tiny", 64))
    x = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        head = model.lm_head(model.norm(model.embed_tokens(x)))  # a bf16 matmul's output
    assert head.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, logits.to(torch.bfloat16).float())  # bf16 values, widened
    assert model(x).dtype == torch.float32


def test_rope_scores_depend_only_on_relative_position():
    D = 16
    rot = RotaryEmbedding(D, max_positions=128, theta=10000.0)
    cos, sin = rot(128)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(D, generator=g), torch.randn(D, generator=g)

    def score(m, n):
        qm = apply_rotary(q[None, None, None], cos[m:m + 1], sin[m:m + 1])
        kn = apply_rotary(k[None, None, None], cos[n:n + 1], sin[n:n + 1])
        return float((qm * kn).sum())

    for m, n, shift in [(5, 2, 40), (0, 0, 100), (9, 30, 17)]:
        assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-4)
    # but a different distance gives a different score
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = spread_weights(make_model())
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    t = 9
    changed[:, t] = (ids[:, t] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax() > 1e-3


def test_gqa_equals_explicitly_repeated_kv_heads():
    """A GQA model (enable_gqa in SDPA) equals a full multi-head model whose K/V
    projections are the GQA ones with each KV head's rows copied for its query heads."""
    gqa = spread_weights(make_model())
    H, KV, D = gqa.config.num_attention_heads, gqa.config.num_key_value_heads, gqa.config.head_dim
    assert KV < H
    mha = make_model(num_key_value_heads=H)
    sd = gqa.state_dict()
    for key, w in list(sd.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            sd[key] = w.view(KV, D, -1).repeat_interleave(H // KV, dim=0).reshape(H * D, -1)
    mha.load_state_dict(sd)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[1, 8:] = 0  # padding in the second sample, for the masked path
    mask = build_attention_mask(ids, pad_id=0)
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gqa(ids, mask), mha(ids, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device, dtype, masked, shares", [
    ("cuda", torch.bfloat16, False, True),   # packed, bf16: flash takes the grouped heads
    ("cuda", torch.bfloat16, True, False),   # padded: flash takes no mask
    ("cuda", torch.float32, False, False),   # fp32: flash takes no fp32
    ("cuda", torch.float32, True, False),
    ("cpu", torch.float32, True, True),      # the CPU's fused kernel takes all of it
    ("cpu", torch.bfloat16, False, True),
])
def test_which_settings_pass_grouped_kv_heads_to_sdpa(device, dtype, masked, shares):
    assert shares_kv_heads(device, dtype, masked=masked) is shares


def test_the_repeated_kv_path_is_what_sdpa_receives_and_equals_gqa(monkeypatch):
    """Where grouped heads would send SDPA to its math kernel, attention repeats K and V
    itself: SDPA then sees as many K/V heads as query heads and no enable_gqa, and the
    model computes the same function."""
    model = spread_weights(make_model())
    H = model.config.num_attention_heads
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[1, 8:] = 0
    mask = build_attention_mask(ids, pad_id=0)
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa", False), kwargs["attn_mask"] is not None))
        return sdpa(q, k, v, **kwargs)
    monkeypatch.setattr("common.model.F.scaled_dot_product_attention", recording)
    with torch.no_grad():
        grouped = model(ids, mask)
        monkeypatch.setattr("common.model.shares_kv_heads", lambda *a, **k: False)
        repeated = model(ids, mask)
    layers = model.config.num_hidden_layers
    assert seen == [(model.config.num_key_value_heads, True, True)] * layers + [(H, False, True)] * layers
    torch.testing.assert_close(repeated, grouped, rtol=1e-5, atol=1e-5)


def test_masked_path_equals_fast_path_without_padding():
    model = spread_weights(make_model())
    pad_id = 0
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = model(ids)                                     # is_causal, no mask tensor
        masked = model(ids, build_attention_mask(ids, pad_id))  # additive causal mask
    torch.testing.assert_close(masked, fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["packed", "padded"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(masked):
    """Checkpointed layers run their forward a second time in backward (counted), and
    that changes nothing: in float64 the loss and every gradient equal
    the plain model's, with or without an attention mask."""
    plain = spread_weights(make_model()).double().train()
    checkpointed = LlamaForCausalLM(plain.config, activation_checkpointing=True).double().train()
    checkpointed.load_state_dict(plain.state_dict())
    ids = torch.randint(1, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))
    if masked:
        ids[1, 14:] = 0  # padding
    x, y = ids[:, :-1], ids[:, 1:]
    mask = build_attention_mask(x, 0) if masked else None
    losses, calls = [], []
    for model in (plain, checkpointed):
        count, layer = [], model.layers[0]
        layer.forward = lambda *a, f=layer.forward: count.append(1) or f(*a)  # (module hooks
        loss = F.cross_entropy(model(x, mask).view(-1, VOCAB), y.reshape(-1))  # skip the rerun)
        loss.backward()
        losses.append(loss)
        calls.append(len(count))
    assert calls == [1, 2]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-15, msg=name)


# ----------------------------------------------------------------------------- init

def test_gpt2_style_init_and_untied_head():
    L = 8
    model = make_model(vocab=512, num_hidden_layers=L)
    residual_std = 0.02 / math.sqrt(2 * L)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        want = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        assert p.std().item() == pytest.approx(want, rel=0.08), name
        assert abs(p.mean().item()) < want / 10, name
    # untied: a separate tensor with its own values
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


# --------------------------------------------------------------------- config errors

def test_heads_must_divide_hidden_size():
    with pytest.raises(ValueError, match=r"num_attention_heads=5.*hidden_size=64"):
        LlamaConfig(hidden_size=64, num_attention_heads=5, num_key_value_heads=5)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match=r"num_key_value_heads=3.*num_attention_heads=4"):
        LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3)


def test_sequence_longer_than_positions_is_refused():
    model = make_model(max_position_embeddings=16)
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly the limit is fine
    with pytest.raises(ValueError, match=r"17.*max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


# -------------------------------------------------------------------------- helpers

def test_num_parameters_counts_every_weight():
    model = make_model()
    cfg = model.config
    h, i, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    want = 2 * V * h + L * per_layer + h
    assert num_parameters(model) == want


def test_flops_per_token_is_the_hand_count_of_the_small_preset():
    """Written out layer by layer from the `small` config: h=256, intermediate 688,
    4 layers, 8 query heads and 2 KV heads of dimension 32, vocabulary 8192, T=256."""
    cfg = get_config("small", 8192)
    h, i, V, L = 256, 688, 8192, 4
    H, Q, kv = 8, 32, 2 * 32
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim,
            cfg.num_attention_heads, cfg.num_key_value_heads) == (h, i, L, Q, H, 2)
    layer = (h * h        # q_proj    65,536
             + h * kv     # k_proj    16,384
             + h * kv     # v_proj    16,384
             + h * h      # o_proj    65,536
             + h * i      # gate_proj 176,128
             + h * i      # up_proj   176,128
             + i * h)     # down_proj 176,128
    assert layer == 692_224
    lm_head = h * V                                  # a matmul: counts (2,097,152)
    matmul_weights = L * layer + lm_head             # embed_tokens and norms do not
    assert matmul_weights == 4_866_048
    T = 256
    attention = L * 3 * (2 * H * Q * T               # scores Q K^T, forward
                         + 2 * H * Q * T)            # probabilities times V, forward
    want = 6 * matmul_weights + attention            # x3: forward + two backward matmuls
    assert want == 32_342_016

    model = LlamaForCausalLM(cfg)
    assert flops_per_token(cfg, num_parameters(model), T) == want
    # the old count, 6 x every parameter, was 39% over it on this preset
    assert (6 * num_parameters(model) + attention) / want == pytest.approx(1.39, abs=0.005)


@pytest.mark.parametrize("preset", ["tiny", "small", "base"])  # larger ones: slow to build
def test_non_matmul_params_are_the_embedding_and_norms(preset):
    model = LlamaForCausalLM(get_config(preset, 300))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert num_parameters(model) - non_matmul_params(model.config) == linear
