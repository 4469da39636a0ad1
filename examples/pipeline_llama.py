"""The linear probe of ``llama_probe.py`` (an 80-layer Llama-2-70B-shaped model, only layer 40 trains)
split over 8 pipeline stages of 10 layers, under the 1F1B schedule with 16 micro-batches: which stage
peaks, when, and by how much, on meta, one rank at a time.

    gradaudit fit examples/pipeline_llama.py:build --world-size 8 --device meta --target cuda --memory 80GiB

The factory runs once per rank inside gradaudit's fake process group, as each rank's training script
builds its part: its stage's module (the embedding on the first, the norm and the head on the last),
a ``PipelineStage`` given its shapes (``input_args``, ``output_args``: a fake process group cannot
infer them at run time; the activations passed on require grad from the stage that trains on, as in
the real run) and the schedule. It returns the schedule and what this rank's ``schedule.step`` takes:
the batch's token ids on the first stage, ``target=`` on the last, nothing between.

Stages are numbered from 0, as the fit names them. Stages 0-2 (layers 1-30) hold nothing for backward
but the outputs they have sent (the schedule keeps each until its backward): nothing before layer 40
trains. Stage 3 (layers 31-40) holds what layer 40's weight gradients need, and its optimizer state;
stages 4-7 hold, for every micro-batch in flight, what the gradient needs to flow back through their
frozen layers to layer 40 (1F1B: stage s of 8 runs 8 - s forwards before its first backward), and the
last stage the logits' loss. The batch is causal with no padding: a stage passes one tensor on.
"""

import torch
from torch import nn

STAGES, LAYERS, PROBED, SEQUENCE, BATCH, MICRO_BATCHES = 8, 80, 40, 2048, 16, 16


class LlamaStage(nn.Module):
    """Consecutive decoder layers of a ``LlamaForCausalLM``, with its embedding on the first stage and its
    final norm and head on the last."""

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = model.model.layers
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            out = layer(hidden, position_embeddings=cos_sin, position_ids=positions)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build():
    """This rank's stage of the probe under 1F1B, on meta: (schedule, this rank's step inputs)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from transformers import LlamaForCausalLM

    from llama_probe import config

    rank = dist.get_rank()
    per = LAYERS // STAGES
    first, last = rank == 0, rank == STAGES - 1
    with torch.device("meta"):  # only this stage's layers, no weights allocated
        part = LlamaForCausalLM._from_config(config(per), attn_implementation="sdpa").to(torch.bfloat16)
    stage_module = LlamaStage(part, first, last)
    stage_module.requires_grad_(False)
    probed = PROBED - 1 - rank * per  # layer 40's index within this stage, if it is here
    if 0 <= probed < per:
        stage_module.layers[probed].requires_grad_(True)
    stage_module.train()
    # the activations passed on require grad from the stage that trains on (layers 40-80's inputs)
    trains_before = rank * per >= PROBED  # a layer before this stage trains: its input needs a gradient
    trains_here_or_before = (rank + 1) * per >= PROBED
    size = BATCH // MICRO_BATCHES
    hidden = lambda grad: torch.empty(size, SEQUENCE, 8192, dtype=torch.bfloat16, device="meta",  # noqa: E731
                                      requires_grad=grad)
    example_in = torch.zeros(size, SEQUENCE, dtype=torch.long, device="meta") if first else hidden(trains_before)
    example_out = (torch.empty(size, SEQUENCE, 32000, dtype=torch.bfloat16, device="meta", requires_grad=True)
                   if last else hidden(trains_here_or_before))
    stage = PipelineStage(stage_module, rank, STAGES, torch.device("meta"), input_args=(example_in,),
                          output_args=(example_out,))
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    tokens = torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
    return schedule, ((tokens,) if first else ({"target": tokens} if last else ()))
