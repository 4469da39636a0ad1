"""Pipeline parallelism: each stage's whole training step in a real multi-process run against gradaudit's
fit of the same rank in a fake process group, to the byte.

tests/gloo_world.py runs the ``pp_{model}_{schedule}_m{M}`` builders of tests/distributed_models.py on
real processes joined by gloo (one stage per rank, as many stages as ranks), measuring each rank's
steady-state step (the schedule's ``step``, then AdamW's) with gradaudit.measure's tracker; here
``gradaudit.per_rank`` fits each rank in its own fake world. A plain MLP and the stock Llama (4 decoder
layers) under GPipe and 1F1B, with 2 and 4 stages and several micro-batch counts; the MLP also under
Interleaved1F1B and InterleavedZeroBubble (its residual form: see ResidualMLPStage) with two stages on
each of two ranks, ZBVZeroBubble and DualPipeV (V-shaped: a rank's two stages adjacent, passing each other
their outputs and gradients); a residual MLP split by torch's ``pipeline()`` (its stages' shapes
traced); and the residual MLP with each stage's MLP under activation checkpointing.

Also caught: the oracle's loop over the tensors a V-shaped rank's stages had passed each other kept the
last of them alive through the step it measured (a loop variable), 32768 bytes more than gradaudit's
figure; a comprehension holds none.

What the comparison caught on its way: a send's Work in a real backend holds the tensor it sends for
the Work's life, and 1F1B's first stage keeps the Work of its first forward send until the step ends,
past the backward that frees that output in the fake world (32768 bytes more on the MLP's stage 0 with
4 micro-batches): gradaudit now holds what is sent while the schedule holds the send
(``torchapi.pipelining.sends_held_by_their_work``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from gloo_world import World, resolve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch without torch.distributed or gloo"),
]

HAS_HF = importlib.util.find_spec("transformers") is not None

# (builder, world size: the number of stages); a builder may run in worlds of several sizes
WORLDS = [
    ("pp_mlp_gpipe_m2", 2), ("pp_mlp_gpipe_m8", 2), ("pp_mlp_1f1b_m2", 2), ("pp_mlp_1f1b_m8", 2),
    ("pp_mlp_gpipe_m4", 4), ("pp_mlp_1f1b_m4", 4), ("pp_mlp_1f1b_m8", 4),
    ("pp_llama_gpipe_m4", 2), ("pp_llama_1f1b_m4", 2), ("pp_llama_gpipe_m8", 4), ("pp_llama_1f1b_m8", 4),
    ("pp_mlp_interleaved_m4", 2),  # two stages per rank: four stages on two ranks
    ("pp_mlp_zb_m4", 2), ("pp_mlp_zb_m8", 2),  # InterleavedZeroBubble: the backward split in input and weights
    ("pp_traced_1f1b_m4", 2), ("pp_traced_gpipe_m4", 4),  # stages split by torch's pipeline(), shapes traced
    ("pp_ckpt_1f1b_m4", 2), ("pp_ckpt_gpipe_m4", 2),  # each stage's MLP under activation checkpointing
    # V-shaped: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2, which pass each other their tensors
    ("pp_mlp_zbv_m4", 2), ("pp_mlp_dualpipev_m4", 2), ("pp_mlp_dualpipev_m8", 2),
]
CASES = list(WORLDS)


def _v_on_gloo() -> bool:
    """Whether gloo can run a V-shaped schedule here: torch 2.11 opens a schedule of several stages per rank
    with a send to each neighbouring stage (``_get_init_p2p_neighbors_ops``), its own rank's included,
    which gloo cannot do; 2.14 votes over the stages instead of it for static shapes
    (``_warmup_forward_vote``), and 2.15 has no such opening."""
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, "_warmup_forward_vote") or not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops")


def _why_not(builder: str) -> str:
    """Why ``builder`` cannot run here ("" where it can)."""
    if "llama" in builder and not HAS_HF:
        return "needs transformers"
    if ("_zbv_" in builder or "_dualpipev_" in builder) and not _v_on_gloo():
        return "gloo cannot run a V-shaped schedule on this torch (its first step sends to its own rank)"
    return ""


def _builders(size: int) -> list[str]:
    return [b for b, n in WORLDS if n == size and not _why_not(b)]


def _fit(builder: str, world_size: int) -> dict[int, "object"]:
    import gradaudit

    build = resolve(f"distributed_models:{builder}")

    def built():
        torch.manual_seed(0)
        return build(dist.get_rank(), dist.get_world_size())

    return gradaudit.per_rank(built, world_size, lambda schedule, inputs: gradaudit.fit(
        schedule, inputs, memory=2**40, optimizer="adamw", remedy=False)).results


@pytest.fixture(scope="module")
def runs():
    """{(builder, world size): (real figures by rank, gradaudit's Fit by rank)}."""
    worlds = {size: World([f"distributed_models:{b}" for b in _builders(size)], size, timeout=600)
              for size in sorted({n for _, n in WORLDS})}
    try:
        fitted = {(b, n): _fit(b, n) for b, n in WORLDS if b in _builders(n)}
        real = {}
        for size, world in worlds.items():
            for name, ranks in world.result().items():
                real[(name.partition(":")[2], size)] = ranks
    finally:
        for world in worlds.values():
            world.kill()
    return {key: (real[key], fitted[key]) for key in fitted}


@pytest.mark.parametrize("builder,world_size", CASES, ids=[f"{b}-w{n}" for b, n in CASES])
def test_each_stage_peaks_as_the_real_run(runs, builder, world_size):
    if (builder, world_size) not in runs:
        pytest.skip(_why_not(builder))
    real, fitted = runs[(builder, world_size)]
    assert sorted(real) == sorted(fitted) == list(range(world_size))
    for rank in real:
        assert real[rank]["backend"] == "gloo"
        assert fitted[rank].peak_bytes == real[rank]["step_peak"], (builder, rank, fitted[rank].peak_phase)


def _activations_at_end_of(fit, phase: str) -> int:
    """The activations alive when ``phase`` ends, from the fit's own storages."""
    from gradaudit.tracking import Category, sweep

    run = fit.live.run
    end, samples = 0, sum(n for _, n in run.phases)
    for name, count in run.phases:
        end += count
        if name == phase:
            break
    else:
        raise AssertionError(f"no phase {phase!r}")
    held = [life for life in run.lives if life.category == Category.ACTIVATIONS]
    return sweep(held, samples, [Category.ACTIVATIONS], lambda n: n)[0][end - 1]


# torch 2.15 allocates a receive buffer just before each receive and hands it to the computation
# (torch/distributed/pipelining/_recv_buffers.py), and frees a stage's output once its send is done;
# before, a stage kept one buffer per micro-batch from its first step on, and its outputs until the step
# ended (held by the sends' works)
PER_RECEIVE = importlib.util.find_spec("torch.distributed.pipelining._recv_buffers") is not None


def test_hand_checked_mlp_stages(runs):
    """pp_mlp_*: each stage Linear(64, 256), ReLU, Linear(256, 64) on micro-batches of 32/M x 16 x 64
    float32, M = 4 here. A micro-batch held for its backward on a stage: the ReLU's result (saved by ReLU
    and by the second Linear: 8*16*256*4 = 131072 bytes), the stage's input (saved by the first Linear:
    on the first stage a view of the batch, an input; on the others what it received, 8*16*64*4 = 32768)
    and, until it is freed, its output (32768). On the last stage each micro-batch's loss until its
    backward: on the CPU a mean squared error's scalar is a view of its elementwise buffer, 32768 bytes
    (tests/test_meta.py); the last one the schedule still holds when the step ends, and the output chunks
    it keeps to merge, are kept over (temporaries, not held for a backward).

    torch 2.11-2.14: each stage keeps one receive buffer per micro-batch from its first step on (the
    pipeline's buffers: the activations it is sent, stages 1-3, and the gradients sent back, stages 0-2,
    32768 bytes each: 131072 on the first and last stage, 262144 between), and its outputs until the
    step ends. When its last forward before a backward ends (GPipe: the 4th; 1F1B: the (4 - s)th):
    GPipe 4 * (131072 + 32768) = 655360 on stages 0-2, 4 * 131072 + 3 * 32768 = 622592 on the last;
    1F1B stage 0 four micro-batches (655360), stage 1 three (491520), stage 2 two (327680).

    torch 2.15: no kept buffers (what a stage receives is an activation or a temporary); an output is
    freed once sent. GPipe: stage 0 4 * 131072 = 524288 (its sends done), stages 1-2 4 * (131072 + 32768)
    = 655360, the last 655360 + 3 * 32768 = 753664. 1F1B, whose last forward's send waits for the first
    backward: stage 0 524288 + 32768 = 557056, stage 1 3 * 163840 + 32768 = 524288, stage 2 2 * 163840 +
    32768 = 360448, the last 163840 + 32768 (its loss) = 196608."""
    if PER_RECEIVE:
        expectations = (("pp_mlp_gpipe_m4", {0: 524288, 1: 655360, 2: 655360, 3: 753664}),
                        ("pp_mlp_1f1b_m4", {0: 557056, 1: 524288, 2: 360448, 3: 196608}))
        buffers = {0: None, 1: None, 2: None, 3: None}
    else:
        expectations = (("pp_mlp_gpipe_m4", {0: 655360, 1: 655360, 2: 655360, 3: 622592}),
                        ("pp_mlp_1f1b_m4", {0: 655360, 1: 491520, 2: 327680}))
        buffers = {0: 131072, 1: 262144, 2: 262144, 3: 131072}
    for builder, expected in expectations:
        _, fitted = runs[(builder, 4)]
        for rank, held in expected.items():
            last_forward = 4 if "gpipe" in builder else 4 - rank
            assert _activations_at_end_of(fitted[rank], f"forward (micro-batch {last_forward})") == held, (builder, rank)
        assert {rank: fitted[rank].breakdown.get("pipeline_buffers") for rank in range(4)} == buffers
