"""How long the answers people ask for take, and that they stay the same (issue 42): the 80-layer
linear probe (Llama-2-70B's shape on meta, layer 40 trainable, 1 x 2048, bf16) and the Qwen2-1.5B LoRA
step (peft r=16, 4 x 4096, AdamW, bf16, on meta for a GPU), each answer timed in a process of its own on
one thread, beside the same answers from another revision of gradaudit (``--against``), and their JSON
documents compared field by field (the golden outputs: a speed-up that changes a figure is a bug).

    python benchmarks/bench_answers.py                                  # this tree, every case
    python benchmarks/bench_answers.py --against 3adda96                # beside that revision (a git worktree)
    python benchmarks/bench_answers.py --cases audit-80 plan-80 --against HEAD~3

Cases (the goals of issue 42 on one core of the build machine in brackets):
- ``audit-80``: ``gradaudit.audit`` of the probe (<= 1 s);
- ``plan-80``: ``gradaudit.plan(..., budget="4GiB")``, its peaks measured (<= 3 s);
- ``fit-80``: ``gradaudit.fit(..., memory="24GiB", target="cuda")`` with its remedy search (<= 10 s);
- ``largest-80``: ``largest("seq")`` of the probe's fit at 80 GiB (<= 15 s; its 128 GiB of weights
  pass 80 GiB alone, so the answer is 0 with no step run);
- ``largest-80-160``: the same at 160 GiB, where sequences up to ~2000 tokens fit: the search itself;
- ``fit-qwen``: the LoRA step's fit at 24 GiB with its remedy (<= 10 s);
- ``largest-qwen``: ``largest("batch")`` of the LoRA step's fit at 80 GiB (<= 15 s).
Times are the process's CPU seconds for the answer alone (the model built and torch imported before
the clock starts), the fastest of ``--rounds`` processes; a machine shared with other work moves them
by 10-25%, so compare the two columns of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = ("audit-80", "plan-80", "fit-80", "largest-80", "largest-80-160", "fit-qwen", "largest-qwen")


def answer(case: str) -> dict[str, Any]:
    """Build the case's model (untimed), then time its answer: {"seconds": CPU s, "document": JSON}."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path.cwd() / "examples"))
    import gradaudit

    if "-80" in case:
        import llama_probe

        model, inputs = llama_probe.build()
    else:
        import qwen_lora

        model, inputs = qwen_lora.build()
    start = time.process_time()
    if case == "audit-80":
        document = gradaudit.audit(model, inputs).to_dict()
    elif case == "plan-80":
        document = gradaudit.plan(model, inputs, budget="4GiB").to_dict()
    elif case.startswith("fit-"):
        document = gradaudit.fit(model, inputs, memory="24GiB", target="cuda").to_dict()
    else:
        axis, memory = {"largest-80": ("seq", "80GiB"), "largest-80-160": ("seq", "160GiB"),
                        "largest-qwen": ("batch", "80GiB")}[case]
        document = {"largest": gradaudit.fit(model, inputs, memory=memory, target="cuda").largest(axis)}
    return {"seconds": time.process_time() - start, "document": json.loads(json.dumps(document, default=str)),
            "gradaudit": gradaudit.__file__}


def run_case(tree: Path, case: str) -> dict[str, Any]:
    """``answer(case)`` in a fresh process importing gradaudit from ``tree``."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_answers; "
                f"json.dump(bench_answers.answer({case!r}), open({out.name!r}, 'w'))")
        result = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{case} failed in {tree}: {result.stderr.strip()[-2000:]}")
        measured = json.load(open(out.name))
        assert Path(measured["gradaudit"]).is_relative_to(tree), f"{case} imported {measured['gradaudit']}"
        return measured


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """The paths at which two JSON values differ (a field missing on one side included)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b), key=str)
                for d in (differences(a.get(key), b.get(key), f"{where}.{key}") if key in a and key in b
                          else [f"{where}.{key} only in {'this tree' if key in a else 'the other'}"])]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} against {b!r}"]


def worktree(revision: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="gradaudit-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), revision], cwd=ROOT, check=True,
                   capture_output=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--against", metavar="REVISION", help="also time that git revision, side by side")
    parser.add_argument("--rounds", type=int, default=1, help="processes per case and tree (the fastest counts)")
    args = parser.parse_args()
    other = worktree(args.against) if args.against else None
    try:
        print(f"{'case':14} {'this tree':>10} " + (f"{args.against:>12} {'ratio':>6}  outputs" if other else ""))
        for case in args.cases:
            mine = min((run_case(ROOT, case) for _ in range(args.rounds)), key=lambda r: r["seconds"])
            line = f"{case:14} {mine['seconds']:9.2f}s"
            if other is not None:
                theirs = min((run_case(other, case) for _ in range(args.rounds)), key=lambda r: r["seconds"])
                diff = differences(mine["document"], theirs["document"])
                verdict = "equal" if not diff else f"{len(diff)} differ: " + "; ".join(diff[:3])
                line += f" {theirs['seconds']:11.2f}s {mine['seconds'] / theirs['seconds']:6.2f}  {verdict}"
            print(line, flush=True)
    finally:
        if other is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
