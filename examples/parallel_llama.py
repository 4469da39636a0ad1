"""What does each rank hold when a 70B Llama trains on 8 GPUs with FSDP2 and tensor parallelism?

The factory is the training script's model setup, unchanged in kind: it asks torch.distributed for
the world, builds a 2-D DeviceMesh (data parallel x tensor parallel), applies tensor parallelism to
every decoder layer as torchtitan does for Llama (attention and MLP projections column- then
row-parallel), and shards what is left with FSDP2 (``fully_shard``) over the data-parallel dimension.

gradaudit runs it once per rank inside a fake process group, on the meta device: no GPU, no weights,
and the figures are each rank's own (its DTensor shards, FSDP2's gathered weights freed after the
forward and gathered again in backward)::

    gradaudit scan examples/parallel_llama.py:build --world-size 8 --device meta --target cuda
    gradaudit fit examples/parallel_llama.py:build --world-size 8 --rank 0 --device meta --target cuda \\
        --memory 80GiB --optimizer adamw

On a CPU, the same factory with small layers (``build(layers=2, hidden=256)``) runs as it is.
"""

import torch

LAYERS, SEQUENCE, TENSOR_PARALLEL = 80, 2048, 8


def config(layers: int = LAYERS, hidden: int = 8192):
    from transformers import LlamaConfig

    # Llama-2-70B's shape at hidden 8192: 64 heads sharing 8 key/value heads, 28672 MLP, 32000 tokens
    scale = hidden / 8192
    return LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=int(28672 * scale), num_hidden_layers=layers,
        num_attention_heads=max(8, int(64 * scale)), num_key_value_heads=8, max_position_embeddings=4096,
        use_cache=False,
    )


def parallelize(model, mesh) -> None:
    """Tensor parallelism on each decoder layer over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    # bf16 compute, fp32 weights and gradient reduction: FSDP2's mixed precision as torchtitan sets it
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def build(layers: int = LAYERS, hidden: int = 8192, sequence: int = SEQUENCE, tensor_parallel: int = TENSOR_PARALLEL):
    """The stock ``LlamaForCausalLM`` in its training configuration (``use_cache=False``, SDPA), parallelised
    for this rank, and the rank's batch: token ids, a padded attention mask and labels."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    world = dist.get_world_size()
    tp = min(tensor_parallel, world)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM._from_config(config(layers, hidden), attn_implementation="sdpa")
    parallelize(model, mesh)
    model.train()
    # the batch as a collator makes it, on the CPU: values decide what the model's mask code does
    input_ids = torch.zeros(1, sequence, dtype=torch.long)
    attention_mask = torch.ones(1, sequence, dtype=torch.long)
    attention_mask[:, sequence - sequence // 32:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return model, {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
