"""Per-rank audits in one process: FSDP2, tensor and sequence parallel models in a fake process group.

The figures a real multi-process run holds on each rank are checked in tests/test_ranks_gloo.py;
here, what a fake world must get right on its own: local shards, resharded parameters, meta equal
to CPU, the model left usable, the errors and the command line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Optional

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradaudit
from gradaudit.cli import cli
from gradaudit.errors import GradauditError
from gradaudit.ranks import check_world, fake_world, per_rank, rank_list
from gradaudit.records import StorageKind
from gradaudit.schemas import json_schema
from gradaudit.report import fittext

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

D = 64


class Block(nn.Module):
    def __init__(self, d: int = D, hidden: int = 4 * D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = D, hidden: int = 4 * D) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def batch(device: Optional[str] = None) -> torch.Tensor:
    return torch.randn(8, 16, D, device=device)


# device None: the ambient one (gradaudit scan --device meta builds under torch.device("meta"))
def fsdp2(device: Optional[str] = None):
    from torch.distributed.fsdp import fully_shard

    with torch.device(device) if device else contextlib.nullcontext():
        model = Stack()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, batch(device)


def tensor_parallel(device: Optional[str] = None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    with torch.device(device) if device else contextlib.nullcontext():
        model = Stack()
    for layer in model.layers:
        parallelize_module(layer, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, batch(device)


def sequence_parallel(device: Optional[str] = None):
    """Tensor + sequence parallel blocks (as torchtitan's Llama plan: norms SequenceParallel, the
    column-parallel input gathered from Shard(1), the row-parallel output scattered back to it);
    the batch is this rank's shard of the sequence."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    with torch.device(device) if device else contextlib.nullcontext():
        model = Stack()
    for layer in model.layers:
        parallelize_module(layer, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                         "down": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model, mesh, {"head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return model, batch(device)


def audit(model, inputs):
    return gradaudit.audit(model, inputs)


def test_fsdp2_ranks_hold_the_activations_and_regather_the_weights():
    torch.manual_seed(0)
    plain = gradaudit.audit(Stack(), batch())
    results = per_rank(fsdp2, 4, audit, same=lambda r: (r.saved_bytes, r.regathered_bytes))
    assert results.groups == [[0, 1, 2, 3]]
    report = results[0]
    assert (report.world_size, report.rank) == (4, 0)
    # activations per rank do not depend on the sharding: FSDP2 gathers whole weights for the forward
    assert report.saved_bytes == plain.saved_bytes
    # the weights the forward saved are resharded after it: nothing held, gathered again in backward;
    # per block LayerNorm weight and bias 2*64*4 = 512, up.weight 256*64*4 = 65536, down.weight
    # 64*256*4 = 65536 -> 131584; three blocks: 394752 (the head is the root's, kept gathered)
    assert report.regathered_bytes == 3 * (512 + 65536 + 65536) == 394752
    resharded = [s for s in report.storages if s.kind == StorageKind.RESHARDED]
    assert len(resharded) == 12 and all(s.nbytes == 0 for s in resharded)
    # no finding the unsharded model does not have (FSDP2's gathered parameters are the leaves)
    assert sorted(f.code for f in report.findings) == sorted(f.code for f in plain.findings)
    assert any("rank 0 of 4" in note for note in report.notes)
    assert any("gathers them again" in note and "394752 bytes" in note for note in report.notes)
    document = report.to_dict()
    assert document["world"] == {"size": 4, "rank": 0, "regathered_bytes": 394752}
    jsonschema.validate(json.loads(json.dumps(document)), json_schema("report"))  # resharded storages and all


def test_tensor_parallel_saves_count_local_shards():
    torch.manual_seed(0)
    results = per_rank(tensor_parallel, 4, audit, same=lambda r: r.saved_bytes)
    assert results.groups == [[0, 1, 2, 3]]
    # a rank of Colwise up / Rowwise down holds what one block of a quarter of the width holds: the
    # same model with hidden 256 / 4 = 64, unparallelised (parameters are alive anyway either way)
    narrow = gradaudit.audit(Stack(hidden=4 * D // 4), batch())
    assert results[0].saved_bytes == narrow.saved_bytes
    relu = [t for t in results[0].tensors if t.node == "ReluBackward0"]
    assert relu and all(t.shape == (8, 16, 64) for t in relu)  # 256 / 4 local columns
    # and the unparallelised model at full width holds more: per block the ReLU's result (also the
    # down projection's input: one storage) at 256 columns, not 64: 3 * 8*16*(256-64)*4 = 294912
    wide = gradaudit.audit(Stack(), batch())
    assert wide.saved_bytes - results[0].saved_bytes == 3 * 8 * 16 * (256 - 64) * 4


def test_sequence_parallel_gathered_inputs_are_found():
    torch.manual_seed(0)
    report = per_rank(sequence_parallel, 4, audit, ranks=[2])[2]
    # each column-parallel linear (3 up projections and the head) gathers the 16-token shards of 4
    # ranks: 8 x 64 x 64 float32 = 131072 bytes kept, of which this rank's shard is 32768
    gathered = [s for s in report.storages if s.gathered_over]
    assert [(s.nbytes, s.gathered_over) for s in gathered] == [(8 * 64 * 64 * 4, 4)] * 4
    jsonschema.validate(json.loads(json.dumps(report.to_dict())), json_schema("report"))  # gathered_over declared
    findings = [f for f in report.findings if f.code == "GA602"]
    assert sorted(f.module for f in findings) == ["head", "layers.0.up", "layers.1.up", "layers.2.up"]
    assert all(f.bytes == 131072 - 32768 == 98304 and f.rewrite for f in findings)
    assert "keeps 131072 bytes all-gathered over 4 ranks" in findings[0].message
    # tensor parallel without sequence parallel gathers nothing: no finding
    plain = per_rank(tensor_parallel, 4, audit, ranks=[0])[0]
    assert not any(s.gathered_over for s in plain.storages) and not any(f.code == "GA602" for f in plain.findings)


@pytest.mark.parametrize("build", [fsdp2, tensor_parallel, sequence_parallel], ids=["fsdp2", "tp", "tp+sp"])
def test_meta_equals_cpu(build):
    cpu = per_rank(build, 4, audit, ranks=[1])[1]
    meta = per_rank(lambda: build("meta"), 4, audit, ranks=[1], device="meta")[1]
    assert meta.device == "meta"
    assert (meta.saved_bytes, meta.regathered_bytes) == (cpu.saved_bytes, cpu.regathered_bytes)
    assert sorted(f.code for f in meta.findings) == sorted(f.code for f in cpu.findings)


def test_model_left_usable_after_an_audit():
    torch.manual_seed(0)
    with fake_world(2, 1):
        model, x = fsdp2()
        first = gradaudit.audit(model, x)
        second = gradaudit.audit(model, x)  # the root's gathered parameters were resharded after the first
        assert second.saved_bytes == first.saved_bytes
        model(x).backward()
        assert all(p.grad is not None for p in model.parameters())
    assert not torch.distributed.is_initialized()


def test_world_errors():
    with pytest.raises(GradauditError, match="whole number >= 1"):
        check_world(0)
    with pytest.raises(GradauditError, match="rank 4 is not a rank of a world of 4"):
        check_world(4, [4])
    with pytest.raises(GradauditError, match="must be 'cpu' or 'meta'"):
        with fake_world(2, 0, device="cuda"):
            pass
    hook = sys.excepthook
    with fake_world(2, 0):
        with pytest.raises(GradauditError, match="already initialised"):
            with fake_world(2, 1):
                pass
        model, x = fsdp2()
        with pytest.raises(GradauditError, match="verify=True"):
            gradaudit.audit(model, x, verify=True)
    assert sys.excepthook is hook  # init_process_group's "[rankN]: " prefixing hook is undone
    assert rank_list([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"


def test_fit_per_rank_counts_the_local_shards():
    full = sum(p.numel() * 4 for p in Stack().parameters())  # 3*(64*2 + 256*64+256 + 64*256+64) + 64*10+10
    assert full == 401192
    fits = per_rank(fsdp2, 2, lambda m, x: gradaudit.fit(m, x, memory=2**30, optimizer="adamw", remedy=False),
                    ranks=[0])
    breakdown = fits[0].breakdown
    # FSDP2 shards every parameter's dim 0 over the world (all are even here): half each; AdamW keeps
    # two moments of the shard and a 4-byte step count per parameter (3 blocks * 6 + head 2 = 20)
    assert breakdown["parameters"] == full // 2 == 200596
    assert breakdown["optimizer_state"] == 2 * (full // 2) + 20 * 4
    # an independent figure for the whole step's peak is the real run's (tests/test_ranks_gloo.py)


CLI_FACTORY = f'''
import sys
sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
from test_ranks import fsdp2, tensor_parallel


def build():
    return fsdp2()


def build_tp():
    return tensor_parallel()
'''


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "parallel.py"
    path.write_text(CLI_FACTORY)
    return str(path)


def test_cli_scan_per_rank(factory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(cli, ["scan", f"{factory}:build", "--world-size", "4", "-q"])
    assert result.exit_code == 0, result.output
    # every rank alike: one header, one summary line, one HTML file per rank
    assert result.output.count("== ") == 1 and "ranks 0-3 of 4 (alike: rank 0 shown)" in result.output
    assert sorted(p.name for p in tmp_path.glob("gradaudit-report.rank*.html")) == [
        f"gradaudit-report.rank{r}.html" for r in range(4)]
    result = runner.invoke(cli, ["scan", f"{factory}:build_tp", "--world-size", "2", "--rank", "1", "--no-html",
                                 "--json", "-", "--device", "meta"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["world_size"] == 2 and [g["ranks"] for g in document["groups"]] == [[1]]
    assert document["groups"][0]["document"]["world"]["rank"] == 1
    result = runner.invoke(cli, ["scan", f"{factory}:build", "--rank", "1", "--no-html"])
    assert result.exit_code == 2 and "--rank needs --world-size" in result.output
    result = runner.invoke(cli, ["scan", f"{factory}:build", "--world-size", "2", "--rank", "2", "--no-html"])
    assert result.exit_code == 2 and "rank 2 is not a rank of a world of 2" in result.output


def test_a_cuda_mesh_on_meta():
    # the training script's own mesh ("cuda") on a machine without CUDA: on meta, FSDP2 keeps its
    # gathered weights there and DTensor never moves a meta tensor; the figures are the "cpu" mesh's
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def build(device_type: str):
        mesh = init_device_mesh(device_type, (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Stack()
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, batch("meta")

    cuda = per_rank(lambda: build("cuda"), 4, audit, ranks=[3], device="meta")[3]
    cpu = per_rank(lambda: build("cpu"), 4, audit, ranks=[3], device="meta")[3]
    assert (cuda.saved_bytes, cuda.regathered_bytes) == (cpu.saved_bytes, cpu.regathered_bytes)
    # tensor parallel 2 halves the MLP's hidden width: one block of hidden 128 per layer, unparallelised
    assert cuda.saved_bytes == gradaudit.audit(Stack(hidden=2 * D), batch()).saved_bytes


@pytest.mark.parametrize("build", [fsdp2, sequence_parallel], ids=["fsdp2", "tp+sp"])
def test_plan_per_rank_holds_what_it_says(build):
    from gradaudit.measure import held_bytes_after_forward

    def planned(model, x):
        plan = gradaudit.plan(model, x, 200_000)  # below what a rank holds unplanned: blocks recompute
        with plan.apply(model):
            measured = held_bytes_after_forward(model, x)  # the independent tracker, the plan in force
        return plan, measured

    torch.manual_seed(0)
    plan, measured = per_rank(build, 2, planned, ranks=[1])[1]
    assert plan.checkpointed and plan.held_bytes <= 200_000
    assert plan.held_bytes == measured


def test_an_audit_in_a_tensor_parallel_world_leaves_no_collective_unwaited():
    """A row-parallel layer's output is an unwaited functional collective until used; the audit uses
    the model's output no further, so it waits it: otherwise the user's process ends with torch's
    "there are still N unwaited collective calls" warning (every pytest run of this suite did)."""
    import pathlib
    import subprocess

    here = pathlib.Path(__file__).resolve().parent
    script = (
        "import sys, torch\n"
        f"sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]\n"
        "import gradaudit\n"
        "from gloo_world import fake_rank\n"
        "from distributed_models import linear_tp\n"
        "with fake_rank(0, 2):\n"
        "    torch.manual_seed(0)\n"
        "    model, inputs = linear_tp(0, 2)\n"
        "    gradaudit.audit(model, inputs)\n"
        "print('audited')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "audited" in result.stdout, result.stderr
    assert "unwaited collective" not in result.stderr


def test_regathered_bytes_count_the_padded_storage_fsdp2_gathers_into():
    """FSDP2 shards dim 0 padded to a multiple of the world size: a 127 x 127 float32 weight over 2
    ranks is gathered into 128 x 127 x 4 = 65,024 bytes (a real FSDPModule.unshard() allocates that),
    of which the parameter views 127 x 127 x 4 = 64,516; backward gathers the storage again."""
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 127, bias=False), nn.ReLU(), nn.Linear(127, 127, bias=False), nn.ReLU(),
                              nn.Linear(127, 4, bias=False))
        fully_shard(model[2])
        fully_shard(model)
        return model, torch.randn(8, 4)

    def regathered(model, inputs):
        return gradaudit.audit(model, inputs).regathered_bytes

    result = per_rank(build, 2, regathered)
    # model[2]'s weight, saved for its input's gradient, is resharded after the forward and gathered again
    # in backward; the root keeps its own gathered weights (alive, not regathered)
    assert set(result.results.values()) == {128 * 127 * 4} == {65024}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def test_data_parallel_in_a_fake_world_runs_with_its_buckets_counted():
    # DDP's reducer waits for an all-reduce's result, which the fake backend's collectives complete with
    # none: gradaudit gives each DDP a hook that reduces nothing, so fit and plan run its backward
    with fake_world(2, 0):
        ddp, x = torch.nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=0.01), torch.randn(8, 64)
        report = gradaudit.audit(ddp, x)
        # 8x128 float32 ReLU result, kept by the second Linear and (as a mask) by ReLU's backward: 4096 bytes;
        # the input x is alive anyway
        assert report.saved_bytes == 8 * 128 * 4
        fit = gradaudit.fit(ddp, x, memory="1GiB", remedy=False)
        plain = gradaudit.fit(_mlp(), x, memory="1GiB", remedy=False)
        # the gradients of 64*128 + 128 + 128*10 + 10 = 9,610 float32 elements: 38,440 bytes of buckets,
        # alive throughout (the peak is the optimizer's step: everything else as without DDP)
        assert fit.breakdown["gradient_buckets"] == 9610 * 4 == 38440
        assert fit.peak_bytes == plain.peak_bytes + 38440
        assert "gradient_buckets" not in plain.breakdown  # a category only where a DDP holds some
        assert any("gradient_as_bucket_view=True would" in note for note in fit.notes)
        assert gradaudit.plan(ddp, x, "1MiB").held_bytes == gradaudit.plan(_mlp(), x, "1MiB").held_bytes
        text = fittext.render(fit)
        assert "DDP's gradient buckets" in text
    with fake_world(2, 0):
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
        gradaudit.audit(ddp, x)  # a forward: DDP now expects its hooks to fire in a backward
        # the module DDP wraps still carries its hooks: said so, not PyTorch's internal assert
        with pytest.raises(GradauditError, match="give gradaudit the DistributedDataParallel itself"):
            gradaudit.fit(ddp.module, x, memory="1GiB")


def test_data_parallel_with_a_hook_of_its_own_is_refused_in_a_fake_world():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    with fake_world(2, 0):
        ddp, x = torch.nn.parallel.DistributedDataParallel(_mlp()), torch.randn(8, 64)
        ddp.register_comm_hook(None, fp16_compress_hook)
        for run in (lambda: gradaudit.fit(ddp, x, memory="1GiB"), lambda: gradaudit.plan(ddp, x, "1MiB")):
            with pytest.raises(GradauditError, match=r"communication hook of its own \(fp16_compress_hook\).*"
                                                     r"build the DDP without register_comm_hook"):
                run()
        assert gradaudit.audit(ddp, x).saved_bytes == 8 * 128 * 4  # a forward needs no hook
