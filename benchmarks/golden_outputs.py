"""Run the README's commands and the examples through the CLI and keep everything they write, so a
refactoring can be checked byte for byte against the tree before it.

    python benchmarks/golden_outputs.py OUT_DIR          # on the old tree, then on the new one
    diff -r OLD_DIR NEW_DIR                              # empty when nothing a user sees changed

Each command's stdout, stderr and exit status go to ``NN.out``; the JSON, HTML and memory-viz files it
writes keep their names under ``NN.*``. Wall-clock figures (``12.3 s``, ``took 4 min``) and the
absolute paths of the checkout and OUT_DIR are replaced by placeholders, since they differ between any two runs.
Runs the CLI in a subprocess per command (as a user would), on the CPU, in about five minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# arguments after "gradaudit"; {o} is OUT_DIR/NN
COMMANDS: list[str] = [
    "scan examples/resnet_surgical.py:build --json {o}.json --html {o}.html",
    "scan examples/resnet_surgical.py:build --trim --html {o}.html",
    "scan examples/resnet_surgical.py:build --memory-viz {o}.pickle --html {o}.html",
    "scan examples/custom_function.py:build --json {o}.json --html {o}.html",
    "scan examples/custom_function.py:build_fixed --html {o}.html",
    "scan examples/bert_checkpointing.py:build --json {o}.json --html {o}.html",
    "scan examples/bert_checkpointing.py:build_checkpointed --verify --html {o}.html",
    "scan examples/llama_probe.py:build --device meta --target cuda --json {o}.json --html {o}.html",
    "plan examples/llama_probe.py:build --budget 8GiB --json {o}.json --html {o}.html",
    "fit examples/llama_probe.py:build --memory 80GiB --target cuda --json {o}.json --html {o}.html",
    "scan examples/parallel_llama.py:build --world-size 8 --rank 0 --device meta --target cuda --json {o}.json --html {o}.html",
    "fit examples/parallel_llama.py:build --world-size 8 --rank 0 --device meta --target cuda --memory 80GiB",
    "rules",
    "explain GA101",
    "scan examples/does_not_exist.py:build --html {o}.html",
    "fit examples/resnet_surgical.py:build --memory lots",
    "scan examples/parallel_llama.py:build --world-size 8 --device meta --target cuda --no-html",
    "scan examples/parallel_llama.py:build --world-size 4 --rank 0 --rank 1 --device meta --target cuda --json -",
    "plan examples/llama_probe.py:build --budget 4GiB --budget 8GiB --no-peak",
    "scan examples/resnet_surgical.py:build --fail-on-waste --select GA1 --no-html",
    "scan examples/resnet_surgical.py:build --max-reclaimable 1KiB --ignore GA2 --no-html -v",
    "fit examples/llama_probe.py:build --memory 24GiB --device meta --target cuda --target-torch 2.11 --no-remedy",
    "fit examples/llama_probe.py:build --memory 24GiB --target cuda --json {o}.json",
    "fit examples/qwen_lora.py:build --target cuda --memory 24GiB --json {o}.json",
]

_CLOCK = re.compile(r"\b\d+(?:\.\d+)?(?: ?)(?:ms|s|min|seconds)\b")


def normalise(text: str, out: Path, root: Path) -> str:
    text = text.replace(str(out.resolve()), "<out>").replace(str(root.resolve()), "<root>")
    return _CLOCK.sub("<time>", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", type=int, nargs="*", help="command numbers to run (default: all)")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose gradaudit and examples run (default: this one)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1")
    for number, line in enumerate(COMMANDS):
        if args.only and number not in args.only:
            continue
        stem = args.out.resolve() / f"{number:02d}"
        argv = [sys.executable, "-m", "gradaudit"] + line.format(o=stem).split()
        done = subprocess.run(argv, cwd=args.root, env=dict(env, PYTHONPATH=str(args.root.resolve())),
                              capture_output=True, text=True)
        stem.with_suffix(".out").write_text(normalise(
            f"$ gradaudit {line.format(o='OUT')}\nexit {done.returncode}\n"
            f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}", args.out, args.root))
        for path in args.out.glob(f"{stem.name}.*"):  # per rank: NN.rank0.json
            if path.suffix in (".json", ".html"):
                path.write_text(normalise(path.read_text(), args.out, args.root))
        print(f"{number:02d} exit {done.returncode}  gradaudit {line.format(o='OUT')}", flush=True)


if __name__ == "__main__":
    main()
