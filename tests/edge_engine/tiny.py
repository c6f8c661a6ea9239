"""A tiny random Llama written to a temporary GGUF file and a Hugging Face directory.

Both hold the same float32 weights (the GGUF with llama.cpp's Q/K row permutation, as
``convert_hf_to_gguf.py`` writes it) and the same byte-level BPE tokenizer, trained here on a
few sentences, with ChatML special tokens at ids 0-2 like SmolLM2.

``quantized=True`` lays the weights out like the real SmolLM2 file: linear layers Q4_1 and
the embedding Q8_0 in the GGUF, their dequantised values in the safetensors directory (so
the float32 reference still equals the GGUF exactly).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, quants
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from edge_engine.loader import permute_for_gguf

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "What is the capital of France? Paris is a city on the Seine.",
    "Hello, world! This is a small test of the tokenizer and the engine.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 34))",
    "Numbers 0123456789 and more numbers 2024, 3.14159.",
    "Café, naïve, résumé, Ünïcödé and façade.",
    "system user assistant You are a helpful assistant.",
] * 20

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 512


def build_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _merges(tok: HFTokenizer) -> list[str]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def build_tiny_model(root: Path, seed: int = 0, *, quantized: bool = False, context: int = CONTEXT) -> tuple[Path, Path]:
    """Write ``root/tiny.gguf`` and ``root/tiny-hf/``; returns both paths (``context``: the
    context window, larger for prompts that carry tool definitions)."""
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=context,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.25,  # large enough that random logits rarely tie
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # random (not unit) norm weights exercise the loader's mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        if quantized:  # what the float32 reference sees: the GGUF's weights, dequantised
            for name, p in model.named_parameters():
                if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
                    qtype = GGMLQuantizationType.Q8_0 if "embed" in name else GGMLQuantizationType.Q4_1
                    data = p.detach().numpy().astype(np.float32)
                    p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(data, qtype), qtype)))
    hf_dir = root / "tiny-hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )

    gguf_path = root / "tiny.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(_merges(tok))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    def add(name: str, array: np.ndarray, qtype: GGMLQuantizationType | None = None) -> None:
        if quantized and qtype is not None:  # re-quantising the dequantised values gives the same grid
            writer.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)

    add("token_embd.weight", sd["model.embed_tokens.weight"], GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(LAYERS):
        for hf, gg in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = permute_for_gguf(w, HEADS)
            elif gg == "attn_k":
                w = permute_for_gguf(w, KV_HEADS)
            add(f"blk.{i}.{gg}.weight", np.ascontiguousarray(w), None if "norm" in gg else GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path, hf_dir
