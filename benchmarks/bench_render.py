"""Render time and size of every reporter for the 80-layer, 69B-parameter Llama config audited on meta.

Goal (issue 4): each renderer < 5 s, HTML < 10 MB. Prints the median of several runs per renderer.
Run: python benchmarks/bench_render.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradaudit
from gradaudit.report import graph, html, jsonout, text


def audit_llama_69b() -> gradaudit.Report:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                         intermediate_size=28672, num_hidden_layers=80, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.requires_grad_(False)
    model.model.layers[40].requires_grad_(True)
    input_ids = torch.zeros((1, 2048), dtype=torch.long, device="meta")
    return gradaudit.audit(model, input_ids)


def timed(function, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    report = audit_llama_69b()
    print(f"audit (meta): {time.perf_counter() - start:.2f} s; {len(report.nodes)} autograd nodes, "
          f"{len(report.tensors)} saved tensors, {len(report.findings)} findings, "
          f"held {report.saved_bytes / 2**30:.1f} GiB")

    renderers = {
        "text": lambda: text.render(report),
        "json": lambda: jsonout.render(report),
        "dot (auto collapse)": lambda: graph.to_dot(report),
    }
    try:
        graph.dot_program()
        renderers["svg (auto collapse)"] = lambda: graph.to_svg(report)
    except graph.GraphvizMissing as error:
        print(f"svg skipped: {error}")
    renderers["html"] = lambda: html.render(report)

    print(f"{'renderer':<22}{'median s':>10}{'size':>14}")
    for name, function in renderers.items():
        seconds, output = timed(function, args.repeat)
        size = len(output.encode("utf-8"))
        print(f"{name:<22}{seconds:>10.3f}{size / 2**20:>11.2f} MiB")
    seconds, document = timed(renderers["html"], 1)
    verdict = "meets" if seconds < 5 and len(document.encode()) < 10 * 10**6 else "MISSES"
    print(f"html: {seconds:.2f} s, {len(document.encode()) / 10**6:.2f} MB -> {verdict} the goal (< 5 s, < 10 MB)")


if __name__ == "__main__":
    main()
