"""Parameter counts from a model's dimensions: the one formula that the model config
(param_count), the memory floor and the simulator all use (numpy-free: the simulator imports it).

Layout (Mixtral's, plus what other families' block choices add): per layer, attention (q and o
over heads x head_dim, k and v over kv heads), a router (hidden x experts), two RMS norms, and
per expert w1, w3 (hidden x ffn) and w2 (ffn x hidden); around the layers an embedding table, a
final norm and an untied lm_head.
"""

from __future__ import annotations


def expert_params(hidden: int, ffn: int, layers: int, *, bias: bool = False) -> int:
  """One expert over all layers (w1, w3, w2; with bias: their biases too, GPT-OSS)."""
  return layers * (3 * hidden * ffn + ((2 * ffn + hidden) if bias else 0))


def mla_attn_params(hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int,
                    qk_nope: int, qk_rope: int, v_head: int) -> int:
  """One layer of multi-head latent attention (DeepSeek-V3): q through rank q_lora_rank (with
  its RMSNorm; 0: one dense projection), the latent + RoPE-key projection, the latent's RMSNorm,
  its expansion into the heads' nope keys and values, and the output projection."""
  qk = heads * (qk_nope + qk_rope)
  q = hidden * q_lora_rank + q_lora_rank + q_lora_rank * qk if q_lora_rank else hidden * qk
  kv = hidden * (kv_lora_rank + qk_rope) + kv_lora_rank + kv_lora_rank * heads * (qk_nope + v_head)
  return q + kv + heads * v_head * hidden


def nonexpert_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                     head_dim: int, experts: int, *, qk_norm: bool = False,
                     dense_ffn: int = 0, attn_bias: bool = False, sinks: bool = False,
                     router_bias: bool = False, dense_count: int | None = None,
                     mla_attn: int = 0, shared_ffn: int = 0,
                     router_correction: bool = False) -> int:
  """Every weight but the experts': what each worker holds replicated. qk_norm: a q and a k
  RMSNorm weight over the head dim per layer (Qwen3-MoE); dense_ffn: a dense SwiGLU of that
  width on `dense_count` layers (default: every layer); attn_bias, sinks, router_bias: q/k/v/o
  biases, a sink logit per head, a router bias (GPT-OSS); mla_attn > 0: each layer's attention
  is that many MLA weights instead of GQA's; shared_ffn: a shared SwiGLU expert of that width
  on every layer; router_correction: a per-expert correction bias (DeepSeek-V3)."""
  d = hidden
  if mla_attn:
    attn = mla_attn
  else:
    attn = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + (
        2 * head_dim if qk_norm else 0)
    attn += ((heads + 2 * kv_heads) * head_dim + d if attn_bias else 0) + (heads if sinks else 0)
  router = d * experts + (experts if router_bias else 0) + (experts if router_correction else 0)
  dense = 3 * d * dense_ffn * (layers if dense_count is None else dense_count)
  return (2 * vocab * d + layers * (attn + router + 2 * d + 3 * d * shared_ffn) + dense + d)


