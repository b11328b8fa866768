"""Tiny random mixture-of-experts HF checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in
transformers' per-expert layout (what ``save_pretrained`` writes) or its fused 3-D layout."""

from __future__ import annotations

import torch

from tests.model_utils import save_byte_tokenizer

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=256, pad_token_id=None)
ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def moe_hf_config(arch: str, **overrides):
    import transformers

    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=6, num_experts_per_tok=2, **overrides)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                                           shared_expert_intermediate_size=72, norm_topk_prob=False,
                                           **{"mlp_only_layers": [1], **overrides})
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                                           norm_topk_prob=True, **overrides)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2, clip_qkv=2.0, **overrides)
    raise ValueError(arch)


def tiny_moe_model(arch: str, path, layout: str = "per_expert", seed: int = 0, **overrides):
    """A random tiny ``arch`` model saved at ``path`` (with a byte tokenizer); ``layout``
    "per_expert" (save_pretrained) or "fused" (``experts.gate_up_proj`` / ``down_proj`` 3-D
    tensors, as transformers holds them). Returns the HF model (float32, eval)."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_hf_config(arch, **overrides),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():  # every parameter random (routers start at zero in some families), norms near 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
            else:
                p.copy_(torch.randn_like(p) * (0.5 if ".gate.weight" in name else 0.08))
    if layout == "per_expert":
        model.save_pretrained(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state), sorted(state)[:20]
        save_file(state, str(path / "model.safetensors"))
    save_byte_tokenizer(path)
    return model


GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def write_moe_gguf(hf_model, arch: str, path, expert_type=None):
    """``hf_model`` (from tiny_moe_model) as llama.cpp's converter lays an MoE model out in GGUF:
    stacked ``ffn_{gate,up,down}_exps`` [experts, out, in], ``ffn_gate_inp`` routers, Llama q/k rows
    permuted for Mixtral (arch ``llama``); float32, or ``expert_type`` (a GGMLQuantizationType)
    for the stacked experts. Byte-level gpt2 tokenizer."""
    import numpy as np
    from gguf import GGUFWriter, quants

    from tokenmill.loading.tokenizer import byte_alphabet

    cfg, name = hf_model.config, GGUF_ARCH[arch]
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    w = GGUFWriter(str(path), name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(512)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "mixtral" and arch != "olmoe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "qwen3_moe":
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    if getattr(cfg, "clip_qkv", None):
        w.add_clamp_kqv(cfg.clip_qkv)
    tokens = [*byte_alphabet().values(), "ab", "<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(len(tokens) - 1)

    def add(tensor_name: str, t: torch.Tensor, qtype=None) -> None:
        data = t.numpy().astype(np.float32)
        if qtype is None:
            w.add_tensor(tensor_name, data)
        else:
            w.add_tensor(tensor_name, quants.quantize(data, qtype), raw_dtype=qtype)

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:  # HF rotate-half rows -> llama.cpp's interleaved
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        if arch == "mixtral":
            q, k = permute(q, cfg.num_attention_heads), permute(k, cfg.num_key_value_heads)
        for gguf_part, t in (("attn_q", q), ("attn_k", k), ("attn_v", state[p + "self_attn.v_proj.weight"]),
                             ("attn_output", state[p + "self_attn.o_proj.weight"]),
                             ("attn_norm", state[p + "input_layernorm.weight"]),
                             ("ffn_norm", state[p + "post_attention_layernorm.weight"])):
            add(f"blk.{i}.{gguf_part}.weight", t)
        for part in ("q", "k", "v"):
            if p + f"self_attn.{part}_proj.bias" in state:
                add(f"blk.{i}.attn_{part}.bias", state[p + f"self_attn.{part}_proj.bias"])
        for part in ("q", "k"):
            if p + f"self_attn.{part}_norm.weight" in state:
                add(f"blk.{i}.attn_{part}_norm.weight", state[p + f"self_attn.{part}_norm.weight"])
        if p + "mlp.gate_proj.weight" in state:  # a dense layer
            for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                add(f"blk.{i}.{ours}.weight", state[p + f"mlp.{theirs}.weight"])
            continue
        gate, up = state[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
        add(f"blk.{i}.ffn_gate_inp.weight", state[p + "mlp.gate.weight"])
        for part, t in (("gate", gate), ("up", up), ("down", state[p + "mlp.experts.down_proj"])):
            add(f"blk.{i}.ffn_{part}_exps.weight", t.contiguous(), expert_type)
        if p + "mlp.shared_expert.gate_proj.weight" in state:
            for part in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{part}_shexp.weight", state[p + f"mlp.shared_expert.{part}_proj.weight"])
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", state[p + "mlp.shared_expert_gate.weight"].reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
