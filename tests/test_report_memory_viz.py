"""The audit's timeline as a memory_viz snapshot, read back with torch's own snapshot readers
(torch.cuda._memory_viz): its totals are the audit's held bytes."""

import pickle
import textwrap

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.cuda import _memory_viz

import gradaudit
from gradaudit.cli import cli
from gradaudit.report import memory_viz
from gradaudit.report.views import timeline

# Input 2x3x8x8 (the caller's: alive anyway) -> conv (weight: a parameter) -> ReLU -> max-pool -> linear.
# Held: the ReLU's result, 2*4*8*8*4 = 2048 bytes (the max-pool saves the same storage: counted once);
# the max-pool's int64 indices, 2*4*4*4*8 = 1024; the linear's input, 2*64*4 = 512.
HELD = [2048, 1024, 512]  # in the order autograd saved them; 3584 in all


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 2))
    return model, torch.randn(2, 3, 8, 8)


@pytest.fixture(scope="module")
def report():
    return gradaudit.audit(*build())


def flamegraph_lines(snapshot):
    """torch's reader of a snapshot's blocks (``memory``), its lines kept as text: 'stream;state;frames size'."""
    return _memory_viz.memory(snapshot, lambda lines: lines).splitlines()  # (positional: its name varies)


def live_bytes(trace):
    """Bytes allocated after each event of a device trace."""
    live, sizes = [], {}
    for event in trace:
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
        elif event["action"] == "free_completed":
            del sizes[event["addr"]]
        live.append(sum(sizes.values()))
    return live


def test_the_snapshot_totals_are_the_audits_held_bytes(report):
    snapshot = memory_viz.snapshot(report)
    assert report.saved_bytes == sum(HELD) == 3584
    lines = flamegraph_lines(snapshot)
    # after backward every storage is freed and cached: inactive blocks, reserved = held bytes
    assert [int(line.rsplit(" ", 1)[1]) for line in lines] == HELD
    assert all(line.split(";")[1] == "inactive" for line in lines)
    summary = _memory_viz.segsum(snapshot)  # torch's allocator summary checks its own accounting
    assert "segments: 3" in summary and "total_allocated: 0.0B" in summary and "total_reserved: 3.5KiB" in summary


def test_the_trace_holds_the_saved_bytes_at_the_end_of_the_forward_and_frees_them_in_backward(report):
    [trace] = memory_viz.snapshot(report)["device_traces"]
    assert [e["action"] for e in trace] == ["alloc"] * 3 + ["free_requested", "free_completed"] * 3
    live = live_bytes(trace)
    # forward: 2048, 2048+1024, 3584 (the audit's timeline, storage by storage); backward: the reverse
    assert live == [2048, 3072, 3584, 3584, 3072, 3072, 2048, 2048, 0]
    assert max(live) == report.saved_bytes == timeline(report)[-1].held_bytes
    # torch's text reader of traces names each allocation and each free
    text = _memory_viz.trace({"segments": [], "device_traces": [trace]})
    assert text.count(" = MEM[") == 3 and text.count("# free completed for ") == 3


def test_blocks_name_the_save_its_verdict_and_module(report):
    [first, *_] = memory_viz.snapshot(report)["segments"]
    [block] = first["blocks"]
    assert [frame["name"] for frame in block["frames"]] == [
        "ReluBackward0.result saved (sign-only, GA401, +1 more saves of it)", "ReLU"]
    assert block["frames"][1]["filename"] == "module 1"


def test_from_events_refuses_a_free_of_nothing():
    with pytest.raises(ValueError, match="freed without being allocated"):
        memory_viz.from_events([memory_viz.Event("free", 7)])


MODELS = textwrap.dedent("""
    import torch
    from torch import nn


    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                              nn.Linear(64, 2))
        return model, torch.randn(2, 3, 8, 8)
""")


def test_scan_writes_the_snapshot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(MODELS)
    result = CliRunner().invoke(cli, ["scan", "models.py:build", "--memory-viz", "held.pickle", "--no-html", "-q"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "memory_viz snapshot: held.pickle" in result.output
    with open(tmp_path / "held.pickle", "rb") as handle:
        snapshot = pickle.load(handle)
    assert [int(line.rsplit(" ", 1)[1]) for line in flamegraph_lines(snapshot)] == HELD
    # the scan noted each layer's construction line: the frames point at models.py
    assert snapshot["segments"][0]["blocks"][0]["frames"][0]["filename"].endswith("models.py")


def test_scan_refuses_an_unwritable_snapshot_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(MODELS)
    result = CliRunner().invoke(cli, ["scan", "models.py:build", "--memory-viz", "missing/held.pickle", "--no-html"])
    assert result.exit_code == 2 and "cannot write --memory-viz missing/held.pickle" in result.output


def test_a_fits_step_exports_as_a_snapshot_whose_trace_peaks_at_the_fits_peak(tmp_path, monkeypatch):
    import pickle

    import torch
    from click.testing import CliRunner

    import gradaudit
    from gradaudit.cli import cli

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    fitted = gradaudit.fit(model, torch.randn(16, 64), memory="1GiB", optimizer="adam", loss=lambda out: out.sum())
    snapshot = memory_viz.fit_snapshot(fitted)
    [trace] = snapshot["device_traces"]
    alive = peak = 0
    for event in trace:
        alive += event["size"] if event["action"] == "alloc" else -event["size"] if event["action"] == "free_completed" else 0
        peak = max(peak, alive)
    assert peak == fitted.peak_bytes
    assert _memory_viz.segsum(snapshot)  # torch's reader takes it
    categories = {block["frames"][0]["filename"] for segment in snapshot["segments"] for block in segment["blocks"]}
    assert {"parameters", "optimizer_state", "gradients", "activations"} <= categories
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlp.py").write_text("import torch\n"
                                     "def build():\n"
                                     "    return torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8)\n")
    result = CliRunner().invoke(cli, ["fit", "mlp.py:build", "--memory", "1MiB", "--memory-viz", "step.pickle"])
    assert result.exit_code == 0, result.output
    assert "memory_viz snapshot: step.pickle" in result.output
    assert pickle.loads((tmp_path / "step.pickle").read_bytes())["device_traces"]
