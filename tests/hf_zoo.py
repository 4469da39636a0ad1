"""Hugging Face architectures built from small configs, in their training configuration.

Each entry names a model class, the config overrides that make it small, and the kind of batch it
trains on. ``batch(kind, device, padded)`` builds that batch as a training collator would: token ids,
an attention mask (with padding: the last tokens of the second sequence masked), labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SEQ, BATCH, VOCAB = 12, 2, 96
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)


@dataclass(frozen=True)
class Arch:
    model: str  # class name in transformers
    family: str  # decoder, moe, encoder, seq2seq, vision, audio
    batch: str  # "text", "text_no_labels", "seq2seq", "pixels", "whisper", "audio"
    overrides: dict[str, Any] = field(default_factory=dict)
    small: bool = True  # start from _SMALL

    @property
    def name(self) -> str:
        return self.model


def _kv(**extra: Any) -> dict[str, Any]:
    return dict(num_key_value_heads=2, **extra)


ARCHS = [
    # decoders
    Arch("GPT2LMHeadModel", "decoder", "text", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
         small=False),
    Arch("LlamaForCausalLM", "decoder", "text", _kv()),
    Arch("Qwen2ForCausalLM", "decoder", "text", _kv()),
    Arch("Qwen3ForCausalLM", "decoder", "text", _kv(head_dim=8)),
    Arch("MistralForCausalLM", "decoder", "text", _kv(sliding_window=8)),
    Arch("GemmaForCausalLM", "decoder", "text", _kv(head_dim=8)),
    Arch("Gemma2ForCausalLM", "decoder", "text", _kv(head_dim=8, sliding_window=8)),
    Arch("PhiForCausalLM", "decoder", "text"),
    Arch("Phi3ForCausalLM", "decoder", "text", _kv(pad_token_id=0)),
    Arch("OPTForCausalLM", "decoder", "text", dict(ffn_dim=64, word_embed_proj_dim=32)),
    Arch("OlmoForCausalLM", "decoder", "text", _kv()),
    Arch("Olmo2ForCausalLM", "decoder", "text", _kv()),
    Arch("GPTNeoXForCausalLM", "decoder", "text"),
    Arch("FalconForCausalLM", "decoder", "text", dict(new_decoder_architecture=True, num_kv_heads=2)),
    Arch("Starcoder2ForCausalLM", "decoder", "text", _kv(sliding_window=8)),
    Arch("BloomForCausalLM", "decoder", "text", dict(n_head=4)),
    Arch("GPTJForCausalLM", "decoder", "text", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
                                                      vocab_size=VOCAB), small=False),
    Arch("StableLmForCausalLM", "decoder", "text", _kv()),
    Arch("GraniteForCausalLM", "decoder", "text", _kv()),
    Arch("CohereForCausalLM", "decoder", "text", _kv()),
    Arch("GPTNeoForCausalLM", "decoder", "text", dict(num_layers=2, attention_types=[[["global", "local"], 1]],
                                                        window_size=8)),
    # mixture of experts
    Arch("MixtralForCausalLM", "moe", "text", _kv(num_local_experts=4, num_experts_per_tok=2)),
    Arch("Qwen2MoeForCausalLM", "moe", "text", _kv(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=32)),
    Arch("Qwen3MoeForCausalLM", "moe", "text", _kv(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   head_dim=8)),
    Arch("OlmoeForCausalLM", "moe", "text", _kv(num_experts=4, num_experts_per_tok=2)),
    # encoders
    Arch("BertForMaskedLM", "encoder", "text"),
    Arch("RobertaForMaskedLM", "encoder", "text", dict(pad_token_id=1)),
    Arch("DistilBertForMaskedLM", "encoder", "text", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64)),
    Arch("AlbertForMaskedLM", "encoder", "text", dict(embedding_size=16)),
    Arch("ElectraForMaskedLM", "encoder", "text", dict(embedding_size=16)),
    Arch("DebertaV2ForMaskedLM", "encoder", "text"),
    Arch("ModernBertForMaskedLM", "encoder", "text", dict(global_attn_every_n_layers=2, local_attention=8,
                                                          pad_token_id=0)),
    Arch("EsmForMaskedLM", "encoder", "text", dict(pad_token_id=1, mask_token_id=2)),
    Arch("XLMRobertaForMaskedLM", "encoder", "text", dict(pad_token_id=1)),
    # encoder-decoders
    Arch("T5ForConditionalGeneration", "seq2seq", "seq2seq", dict(d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                                                  num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0), small=False),
    Arch("BartForConditionalGeneration", "seq2seq", "seq2seq", dict(d_model=32, encoder_layers=2, decoder_layers=2,
         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
         vocab_size=VOCAB, max_position_embeddings=64), small=False),
    Arch("WhisperForConditionalGeneration", "audio", "whisper", dict(d_model=32, encoder_layers=2, decoder_layers=2,
         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
         vocab_size=VOCAB, num_mel_bins=16, max_source_positions=16, max_target_positions=32, pad_token_id=0,
         bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None),
         small=False),
    # vision and audio
    Arch("ViTForImageClassification", "vision", "pixels", dict(image_size=32, patch_size=8, num_labels=3)),
    Arch("Wav2Vec2ForCTC", "audio", "audio", dict(conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8),
                                                  num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
                                                  vocab_size=VOCAB,
                                                  # LayerDrop draws on the CPU generator, which dropout on
                                                  # the CPU also draws from and on meta does not: which
                                                  # layers run would differ by chance (a limit, README)
                                                  layerdrop=0.0)),
]


def build_config(arch: Arch, transformers: Any) -> Any:
    cls = getattr(transformers, arch.model)
    kwargs = dict(_SMALL) if arch.small else {}
    kwargs.update(arch.overrides)
    kwargs["use_cache"] = False
    return cls.config_class(**kwargs)


def build_model(arch: Arch, transformers: Any, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    """The model in train mode, attention through SDPA where the architecture has it."""
    torch.manual_seed(seed)
    cls = getattr(transformers, arch.model)
    with torch.device(device):
        try:
            model = cls._from_config(build_config(arch, transformers), attn_implementation="sdpa")
        except (ValueError, ImportError):  # an architecture without SDPA attention
            model = cls._from_config(build_config(arch, transformers), attn_implementation="eager")
    return model.train()


def batch(arch: Arch, padded: bool, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A training batch on ``device`` (CPU tensors: the values a collator makes)."""
    g = torch.Generator().manual_seed(1)
    if arch.batch == "pixels":
        return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g).to(device),
                "labels": torch.tensor([0, 2]).to(device)}
    if arch.batch == "audio":
        values = torch.randn(BATCH, 400, generator=g)
        out = {"input_values": values}
        if padded:
            mask = torch.ones(BATCH, 400, dtype=torch.long)
            mask[1, 300:] = 0
            out["attention_mask"] = mask
        return {k: v.to(device) for k, v in out.items()}
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    out: dict[str, torch.Tensor] = {}
    if arch.batch == "whisper":
        out["input_features"] = torch.randn(BATCH, 16, 32, generator=g)
        out["labels"] = ids
        return {k: v.to(device) for k, v in out.items()}
    out["input_ids"] = ids
    if padded:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 4:] = 0
        out["attention_mask"] = mask
    labels = ids.clone()
    if padded:
        labels[1, SEQ - 4:] = -100
    out["labels"] = labels
    return {k: v.to(device) for k, v in out.items()}
