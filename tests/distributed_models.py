"""Small parallelised models, each built as its training code would build it on one rank.

Every builder is ``builder(rank, world_size) -> (model, inputs)``: it runs inside an initialised
process group (a real gloo one, tests/gloo_world.py, or PyTorch's fake one in this process), builds
its DeviceMesh on the "cpu" device type, builds the model on the CPU and parallelises it. The model
and the inputs are deterministic: the same on every rank and in every process (the weights from
``torch.manual_seed(0)`` set here, the inputs from a generator of their own).

The llama_* builders use transformers' LlamaForCausalLM from a config (2 layers, hidden 64, 4 heads,
2 key/value heads, vocabulary 128, ``use_cache=False``), given input_ids, a padded attention mask
(the second row padded at its end) and labels: its output is a ModelOutput whose ``loss`` trains.
Tensor parallelism follows torchtitan's ``apply_tp`` for Llama, with Hugging Face's module names.
HF's attention reshapes the projections with ``view(*input_shape, -1, head_dim)``, so it runs on a
rank's local heads (plain local tensors: the colwise projections return their local shard).
"""

from __future__ import annotations

import torch
from torch import nn

SEQ = 16
BATCH = 2
VOCAB = 128


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _llama_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -4:] = 0  # the second row padded at its end
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _tensor_parallel(model: nn.Module, tp_mesh, sequence: bool) -> None:
    """torchtitan's plan for Llama's blocks (q/k/v/gate/up colwise, o/down rowwise); with
    ``sequence``, also its sequence parallelism: the residual stream sharded on the sequence
    (Shard(1)) between the blocks, the norms SequenceParallel, each attention and MLP gathering its
    input (PrepareModuleInput Shard(1) -> Replicate) and reduce-scattering its output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if sequence:
        # The embedding's output stays a DTensor (use_local_output=False): LlamaModel reads the
        # sequence length from it for the positions and the mask, and a DTensor's shape is global.
        parallelize_module(model, tp_mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        if sequence:
            plan.update({
                "input_layernorm": SequenceParallel(),
                # the decoder layer calls its attention with keyword arguments
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            })
        parallelize_module(layer, tp_mesh, plan)


def _fully_shard(model: nn.Module, layers, mesh=None) -> None:
    """FSDP2 as training code applies it: each block, then the root (defaults: the blocks reshard
    after the forward, the root does not)."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def llama_fsdp2(rank: int, world_size: int):
    model = _llama()
    _fully_shard(model, model.model.layers, _mesh((world_size,), ("dp",)))
    return model, _llama_inputs()


def llama_tp(rank: int, world_size: int):
    model = _llama()
    _tensor_parallel(model, _mesh((world_size,), ("tp",)), sequence=False)
    return model, _llama_inputs()


def llama_tp_sp(rank: int, world_size: int):
    model = _llama()
    _tensor_parallel(model, _mesh((world_size,), ("tp",)), sequence=True)
    return model, _llama_inputs()


def llama_fsdp2_tp(rank: int, world_size: int):
    """A 2-D mesh (dp, tp) = (world // 2, 2): tensor parallelism on tp, then FSDP2 on dp."""
    mesh = _mesh((world_size // 2, 2), ("dp", "tp"))
    model = _llama()
    _tensor_parallel(model, mesh["tp"], sequence=False)
    _fully_shard(model, model.model.layers, mesh["dp"])
    return model, _llama_inputs()


class Summed(nn.Module):
    """A classifier whose output is summed into the scalar that trains."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).sum()


def resnet_fsdp2(rank: int, world_size: int):
    from torchvision.models import resnet18

    torch.manual_seed(0)
    net = resnet18(num_classes=10)
    model = Summed(net)
    _fully_shard(model, [net.layer1, net.layer2, net.layer3, net.layer4], _mesh((world_size,), ("dp",)))
    inputs = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return model, inputs


# -- hand-checked: a stack of Linear layers --------------------------------------------------------

D = 64


def linear_fsdp2(rank: int, world_size: int):
    """Linear(64, 64), ReLU, Linear(64, 64), ReLU, Linear(64, 8) on x of (2, 16, 64): the two hidden
    Linears fully_shard'ed, then the root (the Sequential, which so owns the head Linear: by default
    it keeps its gathered parameters after the forward, registered in place of the sharded ones)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 8))
    _fully_shard(model, [model[0], model[2]], _mesh((world_size,), ("dp",)))
    return model, torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1))


def linear_tp(rank: int, world_size: int):
    """Linear(64, 256) colwise, ReLU, Linear(256, 64) rowwise on x of (2, 16, 64)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D))
    parallelize_module(model, _mesh((world_size,), ("tp",)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1))


# -- DistributedDataParallel: gradient buckets ------------------------------------------------------


def _data_parallel(model: nn.Module, **options):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, **options)


def mlp_ddp(rank: int, world_size: int):
    """Linear(64, 256), ReLU, Linear(256, 64) on x of (2, 16, 64) under DDP with 0.05 MiB buckets
    (52,428 bytes: a bucket closes once it holds more). The parameters' gradients, 4 bytes each:
    256*64 + 256 + 64*256 + 64 = 33,088 elements, 132,352 bytes. Rebuilt after the first step in the
    order the gradients become ready (the last Linear's first): [bias 64 + weight 16,384] = 65,792 bytes,
    then [bias 256 + weight 16,384] = 66,560 bytes: two buckets, 132,352 bytes."""
    return _mlp_ddp()


def mlp_ddp_view(rank: int, world_size: int):
    """``mlp_ddp`` with gradient_as_bucket_view=True: the gradients are views of the buckets."""
    return _mlp_ddp(gradient_as_bucket_view=True)


def _mlp_ddp(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D))
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1))
    return _data_parallel(model, bucket_cap_mb=0.05, **options), x


def llama_ddp(rank: int, world_size: int):
    """The Llama above under DDP with 0.1 MiB buckets (several of them)."""
    return _data_parallel(_llama(), bucket_cap_mb=0.1), _llama_inputs()


def resnet_ddp(rank: int, world_size: int):
    """torchvision's ResNet-18 (10 classes) in training under DDP with 1 MiB buckets, its batch norms'
    running statistics broadcast from rank 0 before each forward (DDP's default broadcast_buffers)."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    inputs = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return _data_parallel(Summed(resnet18(num_classes=10)), bucket_cap_mb=1), inputs


# -- pipeline parallelism: one stage per rank -----------------------------------------------------
#
# The Llama's stages are examples/pipeline_llama.py's (its layers, the embedding on the first stage, the
# norm and head on the last; causal attention, no padding: a stage passes one tensor on).
#
# ``pp_{model}_{schedule}_m{M}`` (e.g. pp_mlp_1f1b_m4): a model split into as many stages as the world
# has ranks, this rank's stage under ``torch.distributed.pipelining``'s schedule ("gpipe", "1f1b"; for the
# MLP also two stages per rank: "interleaved" (Interleaved1F1B), "zb" (InterleavedZeroBubble), "zbv" and
# "dualpipev", V-shaped) with M micro-batches. Models: "mlp" (MLPStage), "ckpt" (each stage's MLP under
# activation checkpointing), "llama", "traced" (split by torch's pipeline()). It returns (schedule, what
# this rank's ``schedule.step`` takes): the batch on the first stage, ``{"target": ...}`` on the last,
# nothing between (``gradaudit.Args`` of both on a rank that runs both). Each PipelineStage is given its shapes
# (input_args, output_args: a fake process group cannot infer them at run time), the activations
# passed between stages requiring grad (else the next stage sends no gradient back, and a real run
# waits for it forever).

PP_BATCH = 32


class MLPStage(nn.Module):
    """Linear(64, 256), ReLU, Linear(256, 64): one stage of the pipelined MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class ResidualMLPStage(MLPStage):
    """MLPStage with its input added back: the zero-bubble schedules detach a stage's output in place after
    the backward of its input, which PyTorch refuses for a view (a Linear's output over a 3-D input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def _interleaved_mlp(micro_batches: int, rank: int, world_size: int, schedule: str = "interleaved"):
    """Two MLP stages per rank under a schedule of several stages per rank: Interleaved1F1B and
    InterleavedZeroBubble ("zb") loop (stages rank and rank + world_size of 2 * world_size); ZBVZeroBubble
    ("zbv") and DualPipeV ("dualpipev") run a V (stages rank and 2 * world_size - 1 - rank)."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, schedules

    data = torch.Generator().manual_seed(1)
    batch, target = torch.randn(PP_BATCH, SEQ, D, generator=data), torch.randn(PP_BATCH, SEQ, D, generator=data)
    size, count = PP_BATCH // micro_batches, 2 * world_size
    v_shaped = schedule in ("zbv", "dualpipev")
    stages = []
    for index in (rank, 2 * world_size - 1 - rank) if v_shaped else (rank, rank + world_size):
        torch.manual_seed(index)
        example_in = torch.randn(size, SEQ, D, requires_grad=index > 0)
        module = MLPStage() if schedule == "interleaved" else ResidualMLPStage()
        stages.append(PipelineStage(module, index, count, torch.device("cpu"), input_args=(example_in,),
                                    output_args=(torch.randn(size, SEQ, D, requires_grad=True),)))
    kind = {"interleaved": "ScheduleInterleaved1F1B", "zb": "ScheduleInterleavedZeroBubble",
            "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}[schedule]
    built = getattr(schedules, kind)(stages, n_microbatches=micro_batches,
                                     loss_fn=lambda output, target: F.mse_loss(output, target))
    if v_shaped:  # rank 0 runs the first stage and the last: step(batch, target=target)
        from gradaudit import Args

        return built, Args(batch, target=target) if rank == 0 else ()
    return built, (batch,) if rank == 0 else ({"target": target} if rank == world_size - 1 else ())


class CheckpointedMLPStage(ResidualMLPStage):
    """ResidualMLPStage with its MLP under activation checkpointing (non-reentrant): the stage holds each
    micro-batch's input only, and recomputes the MLP in its backward (``ckpt``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return x + checkpoint(MLPStage.forward, self, x, use_reentrant=False)


class ResidualMLP(nn.Module):
    """Four residual MLP blocks (ResidualMLPStage each), split by torch's ``pipeline()`` into as many stages
    as ranks (``traced``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ResidualMLPStage() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _traced_mlp(schedule: str, micro_batches: int, rank: int, world_size: int):
    """ResidualMLP split by ``pipeline()`` at every (4 / world_size)-th block, this rank's stage traced
    (``pipe.build_stage``: its shapes are the trace's) under GPipe or 1F1B."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    data = torch.Generator().manual_seed(1)
    batch, target = torch.randn(PP_BATCH, SEQ, D, generator=data), torch.randn(PP_BATCH, SEQ, D, generator=data)
    torch.manual_seed(0)
    per = 4 // world_size
    split = {f"layers.{k * per}": SplitPoint.BEGINNING for k in range(1, world_size)}
    pipe = pipeline(ResidualMLP(), mb_args=(batch[:PP_BATCH // micro_batches],), split_spec=split)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    built = kind(stage, n_microbatches=micro_batches, loss_fn=lambda output, target: F.mse_loss(output, target))
    return built, (batch,) if rank == 0 else ({"target": target} if rank == world_size - 1 else ())


def _pipeline(model: str, schedule: str, micro_batches: int, rank: int, world_size: int):
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if model == "traced":
        return _traced_mlp(schedule, micro_batches, rank, world_size)
    if schedule in ("interleaved", "zb", "zbv", "dualpipev"):
        return _interleaved_mlp(micro_batches, rank, world_size, schedule)

    first, last = rank == 0, rank == world_size - 1
    data = torch.Generator().manual_seed(1)
    size = PP_BATCH // micro_batches
    if model in ("mlp", "ckpt"):
        torch.manual_seed(rank)
        stage_module = MLPStage() if model == "mlp" else CheckpointedMLPStage()
        batch = torch.randn(PP_BATCH, SEQ, D, generator=data)
        target = torch.randn(PP_BATCH, SEQ, D, generator=data)
        example_in = torch.randn(size, SEQ, D, requires_grad=not first)
        example_out = torch.randn(size, SEQ, D, requires_grad=True)

        def loss_fn(output, target):
            return F.mse_loss(output, target)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
                             attn_implementation="sdpa")
        from examples.pipeline_llama import LlamaStage

        torch.manual_seed(0)
        full = LlamaForCausalLM(config)
        per = 4 // world_size
        full.model.layers = full.model.layers[rank * per:(rank + 1) * per]  # this stage's layers
        stage_module = LlamaStage(full, first, last)
        del full
        batch = torch.randint(0, VOCAB, (PP_BATCH, SEQ), generator=data)
        target = torch.randint(0, VOCAB, (PP_BATCH, SEQ), generator=data)
        example_in = batch[:size] if first else torch.randn(size, SEQ, 64, requires_grad=True)
        example_out = torch.randn(size, SEQ, VOCAB if last else 64, requires_grad=True)

        def loss_fn(output, target):
            return F.cross_entropy(output.flatten(0, 1), target.flatten())
    stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"), input_args=(example_in,),
                          output_args=(example_out,))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    built = kind(stage, n_microbatches=micro_batches, loss_fn=loss_fn)
    inputs = (batch,) if first else ({"target": target} if last else ())
    return built, inputs


def __getattr__(name: str):
    """``pp_{model}_{schedule}_m{M}`` builders (see above)."""
    parts = name.split("_")
    if len(parts) == 4 and parts[0] == "pp" and parts[1] in ("mlp", "ckpt", "llama", "traced") and \
            parts[3].startswith("m"):
        model, schedule, micro_batches = parts[1], parts[2], int(parts[3][1:])
        return lambda rank, world_size: _pipeline(model, schedule, micro_batches, rank, world_size)
    raise AttributeError(name)
