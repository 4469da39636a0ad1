"""LoRA fine-tuning at full size: will a step fit on a 24 GiB card, and what must change if not?

A Qwen2-1.5B-shaped decoder (28 layers, 1536 wide, 12 heads sharing 2 key/value heads, 8960 MLP,
151,936-token vocabulary, tied embeddings) in bf16 with peft's LoRA (r=16 on the query and value
projections), trained with AdamW on a batch of 4 sequences of 4096 tokens with labels. Built on the
meta device from its config: no weights are downloaded or allocated.

    gradaudit fit examples/qwen_lora.py:build --target cuda --memory 24GiB
    gradaudit fit examples/qwen_lora.py:build --target cuda --memory 80GiB

Needs transformers and peft (``pip install '.[test]'`` has both).
"""

import torch

BATCH, SEQUENCE = 4, 4096


def config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, torch_dtype=torch.bfloat16, use_cache=False)


def build(batch: int = BATCH, sequence: int = SEQUENCE):
    import peft
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config()).to(torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    model.train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (batch, sequence), generator=generator)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
