"""What a real multi-process run holds on each rank, against the same rank in a fake process group.

tests/gloo_world.py runs each builder of tests/distributed_models.py on real processes joined by
gloo on loopback, measuring every rank with gradaudit.measure (the independent tracker); here the
same builders run in this process inside PyTorch's fake process group, one rank at a time. The
bytes autograd holds after the forward must be equal per rank, to the byte: that is what lets a
one-process per-rank audit stand for a real run. gradaudit itself (``per_rank``: ``audit`` and
``fit``) runs each rank in its own fake world and must give the same figures. Two small models are
checked by hand as well.

The real worlds start first, in the background, and the fake ranks are measured while they run:
the machine's cores are shared rather than waited on.

Peaks of the real run are compared only without FSDP2: there, gloo's reduce-scatter of the gradients (``work.wait()``
in ``reduce_scatter_single``) splits a copy of the whole flat gradient buffer on the calling thread,
which the fake backend never allocates (resnet_fsdp2: 93,287,256 bytes real against 76,514,136
fake, the copy of layer4's 33.6 MB buffer at the peak; held equal).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from gloo_world import World, WorldError, fake_rank, resolve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch without torch.distributed or gloo"),
]

HAS_HF = importlib.util.find_spec("transformers") is not None
HAS_TV = importlib.util.find_spec("torchvision") is not None

# builder -> world size; those whose library is missing are left out (and their tests skipped)
WORLDS = {
    "linear_fsdp2": 2,
    "linear_tp": 2,
    "mlp_ddp": 2,
    "mlp_ddp_view": 2,
    **({"resnet_fsdp2": 2, "resnet_ddp": 2} if HAS_TV else {}),
    **({"llama_fsdp2": 2, "llama_tp": 2, "llama_tp_sp": 2, "llama_fsdp2_tp": 4, "llama_ddp": 2} if HAS_HF else {}),
}
ALL = ["linear_fsdp2", "linear_tp", "resnet_fsdp2", "llama_fsdp2", "llama_tp", "llama_tp_sp", "llama_fsdp2_tp",
       "mlp_ddp", "mlp_ddp_view", "llama_ddp", "resnet_ddp"]
DDP = ["mlp_ddp", "mlp_ddp_view", "llama_ddp", "resnet_ddp"]
# no FSDP2: no reduce-scatter, peaks comparable (DDP's all-reduce works in place on its buckets)
NO_FSDP = ["linear_tp", "llama_tp", "llama_tp_sp", *DDP]


def broken(rank: int, world_size: int):
    """A builder for the harness's own failure path, run last in the world of 2: rank 1 raises, rank 0
    hangs (a straggler that only a kill ends)."""
    import time

    if rank == 1:
        raise RuntimeError("rank 1 could not build its model")
    time.sleep(600)


def _fake(builder: str, world_size: int, peak: bool) -> dict[int, dict]:
    """Each rank in a fake process group: held (and with ``peak``, forward_backward's figures)."""
    from gloo_world import measure_rank
    from gradaudit import measure

    figures = {}
    for rank in range(world_size):
        with fake_rank(rank, world_size):
            if peak:
                # the steps' peaks of the fake world are compared only under FSDP2 (the module's docstring)
                figures[rank] = measure_rank(resolve(f"distributed_models:{builder}"), rank, world_size, runs=1,
                                             steps=builder not in NO_FSDP)
                continue
            torch.manual_seed(0)
            model, inputs = resolve(f"distributed_models:{builder}")(rank, world_size)
            parameter_bytes = sum(measure.current_nbytes(key) for key in measure.storage_keys(model.parameters()))
            figures[rank] = {"held": measure.held_bytes_after_forward(model, inputs),
                             "parameter_bytes": parameter_bytes}
            del model, inputs
    return figures


def _gradaudit(builder: str, world_size: int) -> dict[int, dict]:
    """What gradaudit says of each rank, each in its own fake world (``gradaudit.per_rank``): the
    audit's held bytes, and the whole step's peak by ``gradaudit.fit`` (AdamW, no remedy)."""
    import gradaudit

    build = resolve(f"distributed_models:{builder}")

    def built():
        torch.manual_seed(0)
        return build(dist.get_rank(), dist.get_world_size())

    def figures(model, inputs):
        held = gradaudit.audit(model, inputs).saved_bytes
        step = gradaudit.fit(model, inputs, memory=2**40, optimizer="adamw", remedy=False)
        figures = {"held": held, "step_peak": step.peak_bytes, "breakdown": {str(k): v for k, v in step.breakdown.items()}}
        if builder in DDP:
            figures["step_peak_accumulated"] = gradaudit.fit(model, inputs, memory=2**40, optimizer="adamw",
                                                             remedy=False, accumulation=2).peak_bytes
            figures["logged_buckets"] = model._get_ddp_logging_data()["rebuilt_bucket_sizes"]
        return figures

    return gradaudit.per_rank(built, world_size, figures).results


@pytest.fixture(scope="module")
def runs():
    """{builder: (real figures by rank, fake figures by rank)}, and the error of the world of 2, whose
    last builder is ``broken`` (a world of its own would cost two more processes importing torch)."""
    worlds = {size: World([f"distributed_models:{b}" for b, n in WORLDS.items() if n == size]
                          + (["test_ranks_gloo:broken"] if size == 2 else []), size, timeout=300)
              for size in sorted(set(WORLDS.values()))}
    error = None
    try:
        fake = {b: _fake(b, n, peak=True) for b, n in WORLDS.items()}
        audited = {b: _gradaudit(b, n) for b, n in WORLDS.items()}
        real = {}
        for size, world in worlds.items():
            try:
                figures = world.result()
            except WorldError as e:
                if size != 2:
                    raise
                figures, error = e.results, e  # the builders before ``broken`` finished on every rank
            real.update({name.partition(":")[2]: ranks for name, ranks in figures.items()})
    finally:
        for world in worlds.values():
            world.kill()
    missing = [b for b in WORLDS if b not in real]
    assert not missing, f"no real figures for {missing}: {error}"
    return {b: (real[b], fake[b], audited[b]) for b in WORLDS}, error


def _figures(runs, builder):
    if builder not in WORLDS:
        pytest.skip(f"{builder} needs {'torchvision' if builder.startswith('resnet') else 'transformers'}")
    return runs[0][builder]


@pytest.mark.parametrize("builder", ALL)
def test_gradaudit_per_rank_equals_the_real_run(runs, builder):
    """The product's claim: an audit of each rank in one process, in a fake world, holds what that
    rank of a real multi-process run holds, to the byte."""
    real, fake, audited = _figures(runs, builder)
    assert sorted(audited) == list(range(WORLDS[builder]))
    for rank in real:
        assert audited[rank]["held"] == real[rank]["held"] == fake[rank]["held"], (builder, rank)


@pytest.mark.parametrize("builder", ALL)
def test_fit_per_rank_equals_the_measured_step(runs, builder):
    """gradaudit.fit's whole-step peak per rank equals one training step measured by the independent
    tracker on the same rank: in the real run where gloo allocates nothing of its own (tensor and
    sequence parallel, DDP), in the fake world under FSDP2 (gloo's reduce-scatter copies the flat gradient
    buffer on the calling thread: a communication buffer, not modelled; see the module's docstring)."""
    real, fake, audited = _figures(runs, builder)
    for rank in real:
        measured = real[rank]["step_peak"] if builder in NO_FSDP else fake[rank]["step_peak"]
        assert audited[rank]["step_peak"] == measured, (builder, rank, audited[rank], real[rank], fake[rank])


@pytest.mark.parametrize("builder", ALL)
def test_held_per_rank_real_equals_fake(runs, builder):
    real, fake, _ = _figures(runs, builder)
    assert sorted(real) == sorted(fake) == list(range(WORLDS[builder]))
    for rank in real:
        assert real[rank]["backend"] == "gloo" and real[rank]["world_size"] == WORLDS[builder]
        assert real[rank]["held"] == fake[rank]["held"], (builder, rank, real[rank], fake[rank])
        assert real[rank]["parameter_bytes"] == fake[rank]["parameter_bytes"], (builder, rank)
        # the tracker's two ways agree in the real run: a forward alone, a forward then backward
        assert real[rank]["forward_backward_held"] == real[rank]["held"], (builder, rank, real[rank])
        assert real[rank]["held"] > 0


@pytest.mark.parametrize("builder", NO_FSDP)
def test_peak_per_rank_real_equals_fake_without_fsdp2(runs, builder):
    real, fake, _ = _figures(runs, builder)
    for rank in real:
        assert real[rank]["peak"] == fake[rank]["peak"], (builder, rank)
        assert real[rank]["forward_backward_held"] == fake[rank]["forward_backward_held"], (builder, rank)


def test_hand_checked_fsdp2(runs):
    """Sequential(Linear(64, 64), ReLU, Linear(64, 64), ReLU, Linear(64, 8)), x of (2, 16, 64), world 2,
    the hidden Linears fully_shard'ed, then the root (owning the head Linear).

    held: each ReLU's output (ReLU saves its result; the next Linear saves it as its input, the same
    storage): 2*16*64*4 = 8192, twice = 16384. The hidden Linears' gathered weights they saved are
    freed after the forward (resize to 0: 0 bytes); the root keeps its gathered head weight (8*64*4 =
    2048, saved by the head) registered as the parameter: alive anyway, not counted.
    parameters on a rank: 64*64/2*4 + 64/2*4 = 8192 + 128 = 8320 per hidden Linear, twice = 16640;
    the head 8*64/2*4 + 8/2*4 = 1024 + 16 = 1040; 16640 + 1040 = 17680."""
    real, fake, audited = _figures(runs, "linear_fsdp2")
    for figures in [*real.values(), *fake.values()]:
        assert figures["held"] == 16384
        assert figures["parameter_bytes"] == 17680
    assert all(figures["held"] == 16384 for figures in audited.values())


def test_hand_checked_tp(runs):
    """Sequential(Linear(64, 256) colwise, ReLU, Linear(256, 64) rowwise), x of (2, 16, 64), world 2.

    held: the colwise output's local shard, 2*16*(256/2)*4 = 16384, saved by ReLU (its result) and by
    the rowwise Linear (its input, a view of the same storage); x is an input, the all-reduced output
    is dropped: 16384.
    parameters on a rank: colwise 128*64*4 + 128*4 = 32768 + 512; rowwise 64*128*4 = 32768 and its
    bias replicated 64*4 = 256; 66304."""
    real, fake, audited = _figures(runs, "linear_tp")
    for figures in [*real.values(), *fake.values()]:
        assert figures["held"] == 16384
        assert figures["parameter_bytes"] == 66304
    assert all(figures["held"] == 16384 for figures in audited.values())


def test_fsdp2_root_keeps_gathered_parameters_registered():
    """The decision behind excluding the parameters registered after the forward: FSDP2's root does
    not reshard by default; its gathered head weight stays allocated as the registered parameter
    (a plain tensor, no longer a DTensor), while the hidden Linears' gathered weights are freed."""
    from distributed_models import linear_fsdp2
    from gradaudit import measure

    with fake_rank(0, 2):
        model, x = linear_fsdp2(0, 2)
        measure.held_bytes_after_forward(model, x)
        head = model[4].weight
        assert type(head) is torch.nn.Parameter and head.untyped_storage().nbytes() == 8 * 64 * 4
        hidden = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        assert hidden._unsharded_param.untyped_storage().nbytes() == 0  # resharded: freed


def test_harness_reports_failure_kills_stragglers_and_keeps_finished_figures(runs):
    figures, error = runs
    assert error is not None, "a world whose rank 1 raised returned figures"
    message = str(error)
    assert "rank 1 exited with status" in message
    assert "rank 1 could not build its model" in message  # its output, carried in the error
    assert "test_ranks_gloo:broken" not in error.results  # never finished
    assert set(error.results) == {f"distributed_models:{b}" for b, n in WORLDS.items() if n == 2}


@pytest.mark.parametrize("builder", DDP)
def test_fit_per_rank_counts_ddp_buckets_and_accumulation_as_the_real_step(runs, builder):
    """DistributedDataParallel in gradaudit's fake world (its hook reduces nothing) against the real gloo
    run (the default all-reduce): the whole step's peak with one micro-batch and with two (the first under
    no_sync), to the byte; the buckets are a category of their own, as large as DDP says its rebuilt
    buckets are (its logging data, read apart from gradaudit)."""
    real, _, audited = _figures(runs, builder)
    for rank in real:
        assert audited[rank]["step_peak"] == real[rank]["step_peak"], (builder, rank, audited[rank], real[rank])
        assert audited[rank]["step_peak_accumulated"] == real[rank]["step_peak_accumulated"], (builder, rank)
        logged = [int(n) for n in audited[rank]["logged_buckets"].split(",")]
        assert len(logged) > 1  # several buckets
        assert audited[rank]["breakdown"]["gradient_buckets"] == sum(logged)


def test_hand_checked_ddp(runs):
    """mlp_ddp (distributed_models): Linear(64, 256), ReLU, Linear(256, 64), x of (2, 16, 64), world 2,
    buckets of 0.05 MiB. Gradients of 33,088 float32 elements: 132,352 bytes, in two buckets after the
    rebuild (65,792 + 66,560). With gradient_as_bucket_view=False (mlp_ddp) the gradients are separate
    tensors beside the buckets; with True (mlp_ddp_view) they are views of them: the steady-state step
    differs by the gradients, 132,352 bytes (802,068 - 669,716)."""
    for builder in ("mlp_ddp", "mlp_ddp_view"):
        real, _, audited = _figures(runs, builder)
        for rank in real:
            assert audited[rank]["logged_buckets"] == "65792, 66560"
            assert audited[rank]["breakdown"]["gradient_buckets"] == 132352
    separate, views = _figures(runs, "mlp_ddp")[0], _figures(runs, "mlp_ddp_view")[0]
    assert separate[0]["step_peak"] - views[0]["step_peak"] == 132352
    # at each peak (the optimizer's step) the separate gradients are there; the views' are the buckets
    assert _figures(runs, "mlp_ddp")[2][0]["breakdown"]["gradients"] == 132352
    assert _figures(runs, "mlp_ddp_view")[2][0]["breakdown"]["gradients"] == 0
