"""Qwen3's forward pass over the Hugging Face modules, reading and writing a `KVCache`.

It is written out (embeddings, per-head q/k RMSNorm before RoPE, grouped-query attention, SwiGLU
MLP, tied or untied head) rather than calling the modules' `forward`, so it can use the engine's own
slot cache. `prefill` writes one request's context (or the part after a reused prefix) into its
slot, `prefill_batch` several slots' contexts of one length in one forward; `decode` feeds every
running request one token in a single batched step, attending over the first max(length) positions
with a per-slot length mask. Parameters are read live on every call, so
a weight update needs no refresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from reference.engine.kv_cache import KVCache


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """Qwen3RMSNorm, inlined (no module call): normalise in float32, cast back, scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class Qwen3Runner:
    """Qwen3's forward pass over the model's own modules' weights, reading and writing a `KVCache`.

    It reads the live parameters on every call (no fused copies), so a weight update needs no refresh."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        """ValueError for a model this forward pass does not compute: not Qwen3, or with sliding-window layers."""
        config = model.config
        if getattr(config, "model_type", None) != "qwen3":
            raise ValueError(f"BuiltinEngine runs Qwen3 models, got model_type {getattr(config, 'model_type', None)!r}")
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("sliding-window attention layers are not supported by the built-in engine")
        self.model, self.inner = model, model.model
        attn = model.model.layers[0].self_attn
        self.head_dim, self.group = attn.head_dim, attn.num_key_value_groups
        self.device = model.model.embed_tokens.weight.device

    def _qkv(self, attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # h: [B, T, hidden] -> q [B, heads, T, hd], k and v [B, kv_heads, T, hd]; cos, sin: [B, 1, T, hd]
        b, t, _ = h.shape
        q = _rms_norm(_linear(h, attn.q_proj).view(b, t, -1, self.head_dim), attn.q_norm).transpose(1, 2)
        k = _rms_norm(_linear(h, attn.k_proj).view(b, t, -1, self.head_dim), attn.k_norm).transpose(1, 2)
        v = _linear(h, attn.v_proj).view(b, t, -1, self.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    @staticmethod
    def _finish_layer(layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # attended: [B, T, heads * hd]
        x = x + _linear(attended, layer.self_attn.o_proj)
        mlp = layer.mlp
        h = _rms_norm(x, layer.post_attention_layernorm)
        return x + _linear(mlp.act_fn(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor):
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, positions)
        return x, cos.unsqueeze(1), sin.unsqueeze(1)

    def prefill(self, cache: KVCache, slot: int, token_ids: Sequence[int], start: int = 0) -> None:
        """Write the KV of `token_ids` at positions start..start+n-1 into `slot`, attending to the KV of
        positions 0..start-1 already there (a reused prefix); no logits are needed."""
        self.prefill_batch(cache, [slot], [token_ids], start)

    def prefill_batch(self, cache: KVCache, slots: Sequence[int], token_ids: Sequence[Sequence[int]], start: int = 0):
        """`prefill` of several slots in one forward: `token_ids[b]` goes into `slots[b]` at positions
        start..start+n-1 (the same n for every slot), each attending to its own slot's first `start`
        positions."""
        n = len(token_ids[0])
        if n == 0:
            return
        if any(len(t) != n for t in token_ids):
            raise ValueError(f"a batched prefill needs equal lengths, got {sorted({len(t) for t in token_ids})}")
        b, end, dev = len(slots), start + n, self.device
        ids = torch.tensor([list(t) for t in token_ids], device=dev)
        positions = torch.arange(start, end, device=dev)
        x, cos, sin = self._embed(ids, positions[None].expand(b, n))
        rows = slice(slots[0], slots[0] + 1) if b == 1 else torch.tensor(list(slots), device=dev)
        # Causal over the whole context: new token j (position start + j) sees positions 0..start + j.
        mask = None if start == 0 else torch.arange(end, device=dev)[None, :] <= positions[:, None]
        for i, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(layer.self_attn, _rms_norm(x, layer.input_layernorm), cos, sin)
            cache.k[i, rows, :, start:end] = k
            cache.v[i, rows, :, start:end] = v
            if start == 0:
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                keys, values = cache.k[i, rows, :, :end], cache.v[i, rows, :, :end]
                attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = self._finish_layer(layer, x, attended.transpose(1, 2).reshape(b, n, -1))

    def decode(self, cache: KVCache, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed token b at position positions[b] of slot b (b < B), write its KV; logits [B, vocab] float32
        on the CPU (where the samplers' generators live)."""
        b, dev = len(token_ids), self.device
        ids, pos = torch.tensor(list(token_ids), device=dev), torch.tensor(list(positions), device=dev)
        # a lone request sees every position up to its own, so it needs no mask
        return self.decode_step(cache, ids, pos, max(positions) + 1, masked=b > 1).float().cpu()

    def decode_step(self, cache: KVCache, ids: torch.Tensor, pos: torch.Tensor, span: int, masked: bool):
        """`decode` on tensors already on the device (ids, pos: [B]), attending over the first `span`
        positions (masked per slot to its own position when `masked`); logits [B, vocab] in the model's
        dtype, on the device. Nothing here waits for the device, so it can be captured in a CUDA graph."""
        b, dev = ids.shape[0], self.device
        x, cos, sin = self._embed(ids[:, None], pos[:, None])
        # [B, 1, 1, span]
        mask = (torch.arange(span, device=dev)[None, :] <= pos[:, None])[:, None, None, :] if masked else None
        rows = torch.arange(b, device=dev)
        for i, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(layer.self_attn, _rms_norm(x, layer.input_layernorm), cos, sin)
            cache.k[i][rows, :, pos] = k[:, :, 0]
            cache.v[i][rows, :, pos] = v[:, :, 0]
            keys, values = cache.k[i, :b, :, :span], cache.v[i, :b, :, :span]
            # GQA without expanding the cache: the `group` query heads of a KV head become its query rows.
            grouped = q.view(b, keys.shape[1], self.group, self.head_dim)  # [B, kv_heads, group, hd]
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            x = self._finish_layer(layer, x, attended.reshape(b, 1, -1))
        return self.model.lm_head(_rms_norm(x, self.inner.norm))[:, -1]
