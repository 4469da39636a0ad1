"""Every example in examples/ runs and answers its question (as its docstring claims)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import gradaudit
from gradaudit.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scan_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["scan", *args, "--no-html", "--json", "-"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", ["resnet_surgical", "llama_probe", "bert_checkpointing", "custom_function",
                                  "parallel_llama", "qwen_lora", "resnet_compiled"])
def test_each_example_says_what_question_it_answers(name):
    doc = load(name).__doc__
    assert doc and "?" in doc.split("\n\n")[0]
    assert any(f"gradaudit {command} examples/{name}.py:" in doc for command in ("scan", "plan", "fit"))


def test_resnet_surgical_finds_conv_batchnorm_maxpool_and_relu_waste():
    document = scan_json(os.path.join(EXAMPLES, "resnet_surgical.py:build"))
    by_code: dict[str, list[dict]] = {}
    for f in document["findings"]:
        by_code.setdefault(f["code"], []).append(f)
    assert {"GA101", "GA201", "GA301", "GA401"} <= set(by_code)
    # layer1 trains: its convolutions need their inputs; the frozen layers after it do not
    conv_modules = {f["module"] for f in by_code["GA101"]}
    assert not any(m.startswith("layer1.") for m in conv_modules)
    assert {"layer2.0.conv1", "layer3.1.conv2", "layer4.1.conv2"} <= conv_modules
    # the stem's max-pool input: 8x64x64x64 float32 = 8 MiB, also the ReLU's result (needed as a sign),
    # so dropping it alone frees nothing and with bit-packing it frees 8 MiB minus the packed mask;
    # that joint saving is shared equally by the two findings whose fixes it takes
    maxpool = by_code["GA301"][0]
    assert maxpool["module"] == "maxpool" and maxpool["bytes"] == 0
    stem_relu, = [f for f in by_code["GA401"] if f["module"] == "relu"]
    joint = 8 * 64 * 64 * 64 * 4 - 8 * 64 * 64 * 64 // 8  # 8388608 - 262144 = 8126464
    assert maxpool["bytes_together"] == stem_relu["bytes_together"] == joint // 2
    assert stem_relu["severity"] == "waste"
    summary = document["summary"]
    assert 0 < summary["reclaimable_bytes"] < summary["reclaimable_with_bitpacking_bytes"] < summary["saved_bytes"]


def test_resnet_what_if_only_layer4_trains_holds_nothing_before_it():
    document = scan_json(os.path.join(EXAMPLES, "resnet_surgical.py:build"),
                         "--trainable", "layer4.*", "--trainable", "fc.*")
    modules = {t["module"] for t in document["tensors"] if t["storage_kind"] == "activation"}
    assert modules and all(m.startswith(("layer4", "fc", "avgpool")) or m == "" for m in modules)


def test_llama_probe_answers_at_small_scale():
    example = load("llama_probe")
    model, inputs = example.build(layers=6, probed=3, sequence=32)
    assert next(model.parameters()).device.type == "meta"
    layers = example.held_by_layer(gradaudit.audit(model, inputs))
    assert set(layers) == {3, 4, 5, 6}  # layers 1-2 hold nothing: no graph is built before layer 3
    for layer in (4, 5, 6):  # frozen layers after the probe hold activations, and backward needs them
        assert layers[layer]["needed"] > 0 and layers[layer]["not-needed"] == 0


@pytest.mark.slow
def test_llama_probe_script_at_full_size():
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "llama_probe.py")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("80-layer Llama (69.0B parameters), only layer 40 trainable, sequence 2048")
    assert lines[1].split() == ["layers", "1-39", "0", "B", "held:", "0", "B", "needed,", "0", "B", "undecided,",
                                "0", "B", "not", "needed", "in", "full"]
    assert "GiB held" in lines[3] and lines[3].endswith("0 B undecided, 0 B not needed in full")


def test_bert_checkpointing_moves_layer_saves_out_of_the_held_set():
    example = load("bert_checkpointing")
    plain = gradaudit.audit(*example.build())
    checkpointed = gradaudit.audit(*example.build_checkpointed())
    before, after = example.held_by_place(plain), example.held_by_place(checkpointed)
    assert before["encoder layers"] > 0 and after["encoder layers"] == 0
    assert any(t.managed_by == "checkpoint" for t in checkpointed.tensors)
    # what checkpointing cannot remove: embeddings, pooler and classifier are held as before
    assert after["embeddings"] == before["embeddings"] > 0
    assert after["pooler and classifier"] == before["pooler and classifier"] > 0
    # and it keeps each layer's input: 4 layers x 4x64x128 float32 = 4 * 131072
    assert after["checkpoint inputs"] == 4 * 4 * 64 * 128 * 4 and before["checkpoint inputs"] == 0
    assert {t.module for t in checkpointed.held_tensors if t.node == "CheckpointInputs"} == \
        {f"bert.encoder.layer.{i}" for i in range(4)}
    assert checkpointed.saved_bytes < plain.saved_bytes


def test_bert_checkpointing_plan_recomputes_less_than_the_flag_where_the_budget_allows():
    example = load("bert_checkpointing")
    model, inputs = example.build()
    plain = gradaudit.audit(model, inputs).saved_bytes
    flag = gradaudit.audit(*example.build_checkpointed()).saved_bytes
    layers = [f"bert.encoder.layer.{i}" for i in range(4)]
    # at the flag's memory the only plan is the flag: every layer, one extra forward of each
    at_flag = gradaudit.plan(model, inputs, flag, measure_peak=False)
    assert at_flag.checkpointed == tuple(layers) and at_flag.held_bytes == flag
    # at half the plain figure, whole layers only: three do (two would hold more), a quarter less
    # recompute; op by op (matmul outputs kept) less again
    whole = gradaudit.plan(model, inputs, plain // 2, measure_peak=False, selective=False)
    assert len(whole.checkpointed) == 3 and whole.extra_flops * 4 == at_flag.extra_flops * 3
    half = gradaudit.plan(model, inputs, plain // 2, measure_peak=False)
    assert half.selective and half.extra_flops < whole.extra_flops
    for chosen in (whole, half):
        with chosen.apply(model):
            assert gradaudit.audit(model, inputs).saved_bytes == chosen.held_bytes <= plain // 2


def test_custom_function_waste_is_found_with_verify():
    spec = os.path.join(EXAMPLES, "custom_function.py")
    document = scan_json(f"{spec}:build", "--verify")
    unexplained = [f for f in document["findings"] if f["code"] == "GA000"]
    assert sorted(f["module"] for f in unexplained) == ["0", "2"]
    # each sigmoid saves gate(x): 32 x 1024 float32 = 131072 bytes that its backward never reads
    assert all(f["bytes"] == 32 * 1024 * 4 and f["proven"] for f in unexplained)
    static = scan_json(f"{spec}:build")
    assert static["findings"] == [] and static["summary"]["unknown_tensors"] > 0
    assert scan_json(f"{spec}:build_fixed", "--verify")["summary"]["waste_findings"] == 0


def test_parallel_llama_per_rank_on_cpu_and_meta():
    # the factory as the README runs it (world 8, meta) needs 80 layers of 8192: here the same code at
    # 2 layers of 256, tensor parallel 2 and FSDP2 over the other 2 ranks of a world of 4
    build = load("parallel_llama").build

    def small():
        return build(layers=2, hidden=256, sequence=64, tensor_parallel=2)

    def small_on_meta():
        with gradaudit.meta_device():
            return small()

    def audit(model, inputs):
        return gradaudit.audit(model, inputs)

    cpu = gradaudit.per_rank(small, 4, audit, same=lambda r: (r.saved_bytes, r.regathered_bytes))
    assert cpu.groups == [[0, 1, 2, 3]]  # every rank holds alike: even shards, the same batch
    meta = gradaudit.per_rank(small_on_meta, 4, audit, ranks=[3], device="meta")[3]
    assert (meta.device, meta.saved_bytes, meta.regathered_bytes) == ("meta", cpu[0].saved_bytes,
                                                                      cpu[0].regathered_bytes)
    assert cpu[0].regathered_bytes > 0 and cpu[0].world_size == 4


def test_qwen_lora_fits_as_a_lora_step_on_meta_for_cuda():
    # the README runs it at batch 4 x 4096 (24 GiB: 1.5 min on two cores); the same model and code here
    # at 2 x 64 tokens: only the LoRA matrices train, in bf16 beside the frozen bf16 weights
    pytest.importorskip("peft")
    model, batch = load("qwen_lora").build(batch=2, sequence=64)
    fitted = gradaudit.fit(model, batch, memory="80GiB", target="cuda")
    assert fitted.fits and fitted.trained_parameters == 28 * 2 * 2  # lora_A and lora_B of q and v, 28 layers
    assert fitted.breakdown["parameters"] > 2.8 * 2**30 and fitted.headroom > 0
