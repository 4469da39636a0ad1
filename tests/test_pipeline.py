"""Pipeline parallelism in a fake process group: ``gradaudit.fit`` of one rank's stage under a
``torch.distributed.pipelining`` schedule. What a real multi-process run holds is checked in
tests/test_pipeline_gloo.py; here what the fake world must get right on its own: meta equal to the
CPU, the stage left as found, the errors and notes, the command line, and the 80-layer example."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradaudit
from gradaudit.cli import cli
from gradaudit.errors import GradauditError
from gradaudit.ranks import fake_world, per_rank

from distributed_models import MLPStage

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

ROOT = Path(__file__).resolve().parent.parent
# torch 2.15 allocates a stage's receive buffers just before each receive (not kept across steps)
PER_RECEIVE = importlib.util.find_spec("torch.distributed.pipelining._recv_buffers") is not None
D, SEQ, BATCH, MICRO = 64, 16, 32, 4


def build(rank: int, world: int, device: str = "cpu", static: bool = True, schedule: str = "1f1b",
          input_grad: bool = True, batch: int = BATCH, micro: int = MICRO, seq: int = SEQ):
    """One stage of a 2- or 4-stage MLP pipeline (``micro`` micro-batches of ``batch // micro``), and this
    rank's step inputs."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    with torch.device(device):
        torch.manual_seed(rank)
        module = MLPStage()
        x, y = torch.randn(batch, seq, D), torch.randn(batch, seq, D)
        shapes = {}
        if static:
            shapes = {"input_args": (torch.randn(batch // micro, seq, D, requires_grad=rank > 0 and input_grad),),
                      "output_args": (torch.randn(batch // micro, seq, D, requires_grad=True),)}
    stage = PipelineStage(module, rank, world, torch.device(device), **shapes)
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    built = kind(stage, n_microbatches=micro, loss_fn=lambda out, target: nn.functional.mse_loss(out, target))
    return built, ((x,) if rank == 0 else ({"target": y} if rank == world - 1 else ()))


def test_meta_equals_cpu_per_stage():
    def fitted(device):
        def built():
            return build(torch.distributed.get_rank(), 4, device)
        return per_rank(built, 4, lambda s, x: gradaudit.fit(s, x, memory="1GiB"),
                        device="meta" if device == "meta" else None).results

    cpu, meta = fitted("cpu"), fitted("meta")
    for rank in range(4):
        assert meta[rank].device == "meta" and cpu[rank].device == "cpu"
        assert (meta[rank].peak_bytes, meta[rank].peak_phase, meta[rank].breakdown) == (
            cpu[rank].peak_bytes, cpu[rank].peak_phase, cpu[rank].breakdown), rank
    # 1F1B with 4 stages and 4 micro-batches: stage s runs 4 - s forwards before its first backward, and
    # peaks in a backward; its phases are the schedule's order
    assert [f.peak_phase.split(" (")[0] for f in cpu.values()] == ["backward"] * 4
    assert cpu[3].model == "Schedule1F1B, stage 3 of 4, 4 micro-batches"
    phases = [name for name, _ in cpu[1].live.run.phases if name != "schedule set-up"]
    assert phases[:4] == ["forward (micro-batch 1)", "forward (micro-batch 2)", "forward (micro-batch 3)",
                          "backward (micro-batch 1)"]


def test_the_stage_is_left_as_found_and_its_buffers_counted():
    with fake_world(2, 1):
        schedule, inputs = build(1, 2)
        module = schedule._stage.submod
        before = {k: v.clone() for k, v in module.state_dict().items()}
        first = gradaudit.fit(schedule, inputs, memory="1GiB")
        second = gradaudit.fit(schedule, inputs, memory="1GiB")  # the buffers exist now: the same figures
        assert (first.peak_bytes, first.breakdown) == (second.peak_bytes, second.breakdown)
        assert all(p.grad is None for p in module.parameters())
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
        # the last of 2 stages receives each micro-batch's activations: 4 * 8*16*64*4 = 131072 bytes, kept
        # from its first step on before torch 2.15, which allocates each just before it receives
        if PER_RECEIVE:
            assert "pipeline_buffers" not in first.breakdown
        else:
            assert first.breakdown["pipeline_buffers"] == 4 * 8 * 16 * 64 * 4 == 131072
            assert any("4 receive buffers (131072 bytes)" in note for note in first.notes)


def test_what_a_schedule_cannot_take_is_said():
    with fake_world(2, 0):
        schedule, inputs = build(0, 2)
        for options, message in (({"loss": lambda out: out.sum()}, "its own loss_fn"),
                                  ({"autocast": torch.bfloat16}, "autocast is not supported"),
                                  ({"accumulation": 2}, "n_microbatches is the schedule's")):
            with pytest.raises(GradauditError, match=message):
                gradaudit.fit(schedule, inputs, memory="1GiB", **options)
        # a stage left to infer its shapes at run time needs the other ranks
        schedule, inputs = build(0, 2, static=False)
        with pytest.raises(GradauditError, match="build each PipelineStage with input_args and output_args"):
            gradaudit.fit(schedule, inputs, memory="1GiB")
    with fake_world(2, 1):
        # an input that needs no gradient: the stage sends none back, which the stage before must not expect
        schedule, inputs = build(1, 2, input_grad=False)
        fitted = gradaudit.fit(schedule, inputs, memory="1GiB")
        assert any("stage 1's input_args do not require grad" in note for note in fitted.notes)
        # where nothing fits (100 KiB: less than the stage's parameters), every schedule change is measured
        # and the note names what each peaked at
        starved = gradaudit.fit(schedule, inputs, memory="100KiB")
        assert starved.remedy is None and starved.remedy_searched
        assert any("no schedule change measured brings the stage within memory (Schedule1F1B with 8 micro-batches "
                   "of 4" in note for note in starved.notes)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_batch_that_does_not_make_the_stages_micro_batches_is_said_before_the_step(rank):
    """Issue 45 item 1: stages built for micro-batches of 4 (4 of them), given 14 or 32 rows, used to fail
    inside the schedule (rank 0: torch's five-line "Failed to run stage backward"; rank 1: the loss's
    32 vs 24 complaint). Checked before the step, in one line saying what to change."""
    what = "batch" if rank == 0 else "target"
    role = "input_args" if rank == 0 else "output_args"
    for rows, message in ((14, f"the {what} of 14 rows does not split into the schedule's 4 micro-batches: give "
                                f"a {what} of 16 rows (stage {rank}'s {role} are for micro-batches of 4)"),
                          (32, f"the {what} of 32 rows makes 4 micro-batches of 8, but stage {rank}'s {role} "
                                f"are for micro-batches of 4: give a {what} of 16 rows")):
        with fake_world(2, rank):
            schedule, _ = build(rank, 2, batch=16)
            given = torch.randn(rows, SEQ, D)
            with pytest.raises(GradauditError, match=re.escape(message)):
                gradaudit.fit(schedule, (given,) if rank == 0 else {"target": given}, memory="1GiB")


def _fitted(rank: int, memory: str = "1GiB", **shape) -> gradaudit.Fit:
    """The fit of this rank's stage (in the fake world entered) of a pipeline built at ``shape``."""
    schedule, inputs = build(rank, 2, **shape)
    return gradaudit.fit(schedule, inputs, memory=memory)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_largest_micro_batch_sequence_and_count_that_fit_are_measured_answers(rank):
    """A stage's ``Fit.largest`` rebuilds the schedule at each size (its class and loss, fresh stages
    over the same module): what it measures equals a pipeline built at that size by hand, and each answer
    is exact where the memory is that hand-built pipeline's peak (the peak grows with every size)."""
    with fake_world(2, rank):
        fitted = _fitted(rank, schedule="gpipe")  # 4 micro-batches of 8, sequence 16
        sizes = fitted.live.size_search
        hand = {"batch": _fitted(rank, schedule="gpipe", batch=4 * 5),  # micro-batches of 5
                "seq": _fitted(rank, schedule="gpipe", seq=20),
                "micro_batches": _fitted(rank, schedule="gpipe", batch=6 * 8, micro=6)}  # 6 micro-batches of 8
        for dimension, n in (("batch", 5), ("seq", 20), ("micro_batches", 6)):
            assert sizes.measure(dimension, n) == (hand[dimension].peak_bytes, 0), dimension
            memory = hand[dimension].peak_bytes
            assert gradaudit.fit(*build(rank, 2, schedule="gpipe"), memory=memory).largest(dimension) == n
        assert sizes.named("batch", 5) == "micro-batches of 5 (4 of them: a batch of 20)"
        with pytest.raises(GradauditError, match="'batch' or 'seq' or 'micro_batches' here, not 'width'"):
            fitted.largest("width")
    with pytest.raises(GradauditError, match="in a fake process group only"):
        fitted.largest("batch")


def test_a_count_the_memory_does_not_bound_is_said(monkeypatch):
    """Under 1F1B a stage holds at most (stages - its index) micro-batches in flight: more micro-batches
    add their receive buffers and losses only, so a large memory does not bound their count; the search
    stops at the most it runs (a step runs every micro-batch)."""
    from gradaudit.fitting import pipeline
    from gradaudit.fitting.largest import Unbounded

    monkeypatch.setattr(pipeline, "MOST_MICRO_BATCHES", 16)
    with fake_world(2, 1):
        with pytest.raises(Unbounded, match="16, the most searched, fits"):
            _fitted(1).largest("micro_batches")


def test_a_stage_that_does_not_fit_gets_a_schedule_change():
    """The remedy of a stage: 1F1B for GPipe first (the same micro-batches, fewer in flight), then more,
    smaller micro-batches keeping the batch; each measured, its peak that of the pipeline built so by hand."""
    with fake_world(2, 0):
        gpipe, one_f_one_b = _fitted(0, schedule="gpipe"), _fitted(0)
        assert one_f_one_b.peak_bytes < gpipe.peak_bytes  # stage 0 of 2: 2 micro-batches in flight, not 4
        remedied = _fitted(0, memory=str(one_f_one_b.peak_bytes), schedule="gpipe")
        assert not remedied.fits and remedied.remedy.describe() == "Schedule1F1B with 4 micro-batches of 8"
        assert remedied.remedy.peak_bytes == one_f_one_b.peak_bytes
        # 1F1B already: 8 micro-batches of 4 hold half the activations in flight
        smaller = _fitted(0, batch=32, micro=8)
        remedied = _fitted(0, memory=str(smaller.peak_bytes))
        assert remedied.remedy.describe() == "Schedule1F1B with 8 micro-batches of 4"
        assert (remedied.remedy.peak_bytes, remedied.remedy.breakdown) == (smaller.peak_bytes, smaller.breakdown)
        assert "n_microbatches=8" in remedied.remedy.loop_change()
        document = remedied.to_dict()["remedy"]
        assert (document["schedule"], document["micro_batches"], document["micro_batch"]) == ("Schedule1F1B", 8, 4)


def test_a_stage_split_by_torchs_pipeline_fits_and_says_what_it_cannot_rebuild():
    """A stage built by ``pipeline()`` knows its shapes from the trace (no run-time inference): fit runs its
    schedule (checked against real gloo runs in test_pipeline_gloo.py); rebuilding it at another size would
    need another trace, so largest() and the remedy say so. Its audit runs on the trace's shapes."""
    from distributed_models import pp_traced_1f1b_m4

    with fake_world(2, 0):
        fitted = gradaudit.fit(*pp_traced_1f1b_m4(0, 2), memory="100KiB")
        assert fitted.model == "Schedule1F1B, stage 0 of 2, 4 micro-batches" and not fitted.fits
        assert fitted.remedy is None and fitted.no_remedy == "no remedy: the schedule cannot be rebuilt at another size"
        assert any("built by pipeline() (its shapes traced)" in note for note in fitted.notes)
        with pytest.raises(GradauditError, match=r"built by pipeline\(\) \(its shapes traced\)"):
            fitted.largest("batch")
    # the audit of a traced stage past the first runs its module on zeros shaped as the trace's placeholders:
    # two residual blocks of Linear(64, 256), ReLU, Linear(256, 64) on a micro-batch of (8, 16, 64): each
    # ReLU's result (8*16*256*4 = 131072 bytes) and the second block's input (the first's sum, 8*16*64*4 =
    # 32768 bytes), 294912; the stage's own input is the caller's, not held
    with fake_world(2, 1):
        assert gradaudit.audit(*pp_traced_1f1b_m4(1, 2)).saved_bytes == 2 * 131072 + 32768 == 294912


def test_a_v_shaped_rank_keeps_what_its_stages_pass_each_other():
    """ZBVZeroBubble over 4 stages on 2 ranks: rank 1 runs stages 1 and 2, adjacent. Stage 1's output for
    each micro-batch is stage 2's input, and stage 2's input gradient stage 1's output gradient, passed in
    place of a send, and (before torch 2.15) kept in the receiving stage's receive info until the next step
    replaces it. The step followed is the second: the first's 2 * 4 passed tensors (8*16*64*4 = 32768
    bytes each) alive at its start and freed as it replaces them, its own 8 alive at its end, beside the
    8 buffers rank 1 receives from rank 0, kept throughout. (Checked against real gloo runs in
    test_pipeline_gloo.py.) Rank 0 runs the first stage and the last: ``step(batch, target=target)``,
    given as ``gradaudit.Args``."""
    from distributed_models import pp_mlp_zbv_m4

    with fake_world(2, 1):
        fitted = gradaudit.fit(*pp_mlp_zbv_m4(1, 2), memory="1GiB")
    passed = sorted((life.op, life.nbytes, life.died is None) for life in fitted.live.run.lives
                    if life.category.value == "pipeline_buffers")
    if PER_RECEIVE:  # torch 2.15 hands each received or passed tensor to the computation and keeps none
        assert passed == [] and "pipeline_buffers" not in fitted.breakdown
    else:
        assert passed == [("add", 32768, True)] * 8 + [("the last step's pass", 32768, False)] * 8
        assert fitted.live.run.persistent["pipeline_buffers"] == [32768] * 8
        assert any("adjacent stages pass each other" in note for note in fitted.notes)
    with fake_world(2, 0):
        first = gradaudit.fit(*pp_mlp_zbv_m4(0, 2), memory="1GiB")
    assert first.model == "ScheduleZBVZeroBubble, stages 0, 3 of 4, 4 micro-batches"


CLI_FACTORY = '''
import sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_pipeline import build as stage

def build():
    return stage(dist.get_rank(), dist.get_world_size(), schedule="gpipe")
'''


def test_command_line(tmp_path, monkeypatch):
    path = tmp_path / "pipeline.py"
    path.write_text(CLI_FACTORY.format(tests=str(ROOT / "tests")))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(cli, ["fit", f"{path}:build", "--world-size", "2", "--memory", "1GiB", "--json", "-"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [g["ranks"] for g in document["groups"]] == [[0], [1]]
    last = document["groups"][1]["document"]
    assert last["model"] == "ScheduleGPipe, stage 1 of 2, 4 micro-batches"
    assert last["breakdown"].get("pipeline_buffers") == (None if PER_RECEIVE else 131072)
    assert last["peak_phase"].startswith("backward")
    # scan audits each rank's stage module on one micro-batch: the ReLU's result, 8*16*256*4 = 131072 bytes
    # (the stage's input is the batch's first micro-batch or a zero example: an input, not held)
    result = runner.invoke(cli, ["scan", f"{path}:build", "--world-size", "2", "--no-html", "--json", "-"])
    assert result.exit_code == 0, result.output
    for group in json.loads(result.stdout)["groups"]:
        assert group["document"]["summary"]["saved_bytes"] == 131072
        assert any("on one micro-batch of 4" in note for note in group["document"]["notes"])
    # the largest micro-batch count whose step fits, per rank (GPipe: every micro-batch in flight)
    result = runner.invoke(cli, ["fit", f"{path}:build", "--world-size", "2", "--memory", "2MiB", "--largest",
                                 "micro-batches", "--json", "-"])
    assert result.exit_code == 0, result.output
    found = [g["document"]["largest"]["micro-batches"] for g in json.loads(result.stdout)["groups"]]
    assert all(n >= 4 for n in found)
    assert f"largest micro-batches that fits as it is: {found[0]}, {found[0]} micro-batches of 8" in result.stderr
    result = runner.invoke(cli, ["plan", f"{path}:build", "--world-size", "2", "--budget", "1MiB"])
    assert result.exit_code == 2 and "plan takes a module (the stage's: stage.submod)" in result.output


def test_the_80_layer_probe_over_8_stages(monkeypatch):
    """examples/pipeline_llama.py on meta for CUDA (stages numbered from 0, as the fit names them): stage
    0 (layers 1-10) trains nothing; stage 3 (layers 31-40) holds layer 40's optimizer state; stage 4
    (layers 41-50, frozen, the gradient flowing through them to layer 40) peaks in the backward of its
    fourth micro-batch, with 8 - 4 = 4 micro-batches in flight under 1F1B (in the second's on torch 2.15,
    whose receive buffers are allocated per receive)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import pipeline_llama

    fits = per_rank(pipeline_llama.build, 8, lambda s, x: gradaudit.fit(s, x, memory="80GiB", target="cuda"),
                    ranks=[0, 3, 4], device="meta").results
    assert fits[0].breakdown["optimizer_state"] == 0 and any("nothing to step" in n for n in fits[0].notes)
    assert fits[3].breakdown["optimizer_state"] > 0  # layer 40: AdamW's two moments of its weights
    assert fits[4].peak_phase == f"backward (micro-batch {2 if PER_RECEIVE else 4})"
    assert fits[4].breakdown["activations"] > 20 * 2**30


def test_the_html_timeline_labels_a_pipelines_phases_where_they_have_room():
    from gradaudit.report.fithtml import LABEL_ROOM, MANY_PHASES, timeline_chart

    # 16 micro-batches' forwards and backwards, 10 samples each: 32 phases on an 800-pixel-wide plot
    timeline = [{"sample": i, "phase": f"{kind} (micro-batch {k})", "activations": 1000 + i}
                for i, (kind, k) in enumerate((kind, k) for kind in ("forward", "backward")
                                              for k in range(1, 17) for _ in range(10))]
    chart = timeline_chart(timeline, 10**6, ["activations"], 10**6)
    assert len(chart["phases"]) == 32 > MANY_PHASES  # a line for each
    shown = [p for p in chart["phases"] if p["name"]]
    assert 2 < len(shown) < 32 and shown[0]["name"] == "forward (micro-batch 1)"
    spans = sorted((p["lx"] if p["anchor"] == "start" else p["lx"] - LABEL_ROOM) for p in shown)
    assert all(b - a >= LABEL_ROOM for a, b in zip(spans, spans[1:]))  # no label over another
    assert all(p["lx"] <= chart["right"] for p in shown if p["anchor"] == "end")


def test_an_audit_of_a_schedule_audits_the_stage_on_one_micro_batch():
    with fake_world(2, 0):
        schedule, inputs = build(0, 2)
        report = gradaudit.audit(schedule, inputs)
        # the module on the batch's first micro-batch (32 rows in 4): its ReLU's result, 8*16*256*4 bytes
        direct = gradaudit.audit(schedule._stage.submod, inputs[0][:8])
        assert report.saved_bytes == direct.saved_bytes == 8 * 16 * 256 * 4
        assert any("stage 0 of 2 (Schedule1F1B) on one micro-batch of 4" in note for note in report.notes)
    with fake_world(2, 1):
        schedule, inputs = build(1, 2)  # a zero input of the stage's input_args, requiring grad as given
        assert gradaudit.audit(schedule, inputs).saved_bytes == 8 * 16 * 256 * 4
