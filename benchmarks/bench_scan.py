"""Wall time and peak memory of `gradaudit scan` on the 80-layer, 69B-parameter Llama on meta.

The example is the stock LlamaForCausalLM (SDPA attention) with a padded batch. Goals: <= 15 s wall and
<= 2 GiB peak RSS (issue 5); <= 6 s and <= 1 GiB (issue 20). Each run is a fresh process (imports
included, as a user sees it), interleaved with a process that only imports what the scan imports
(torch, transformers' Llama, gradaudit's CLI): the difference is what the scan itself costs, and the
imports' share is this machine's, not gradaudit's. Peak RSS comes from os.wait4's per-child resource
usage, so one run cannot hide another's peak.

    python benchmarks/bench_scan.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_SECONDS, GOAL_RSS = 15.0, 2 * 1024**3


IMPORTS = [sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama, gradaudit.cli"]


def imports_only() -> float:
    start = time.perf_counter()
    subprocess.run(IMPORTS, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def one_run(folder: str) -> tuple[float, int, int]:
    html, js = os.path.join(folder, "report.html"), os.path.join(folder, "report.json")
    command = [sys.executable, "-m", "gradaudit", "scan", os.path.join(ROOT, "examples", "llama_probe.py:build"),
               "--device", "meta", "--html", html, "--json", js, "-q"]
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    out, err = child.stdout.read().decode(), child.stderr.read().decode()
    if child.returncode != 0:
        raise SystemExit(f"scan failed ({child.returncode}):\n{out}{err}")
    rss = usage.ru_maxrss * 1024  # kilobytes on Linux
    return wall, rss, os.path.getsize(html) + os.path.getsize(js)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    walls, peaks, imports = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(runs):
            imports.append(imports_only())
            wall, rss, written = one_run(folder)
            walls.append(wall)
            peaks.append(rss)
            print(f"run {i + 1}: {wall:6.2f} s wall ({imports[-1]:.2f} s a process that only imports), "
                  f"{rss / 1024**2:7.0f} MiB peak RSS, {written / 1024**2:.1f} MiB of HTML+JSON written")
    median, peak = statistics.median(walls), max(peaks)
    print(f"imports alone: median {statistics.median(imports):.2f} s; the scan's own work: median "
          f"{statistics.median(w - i for w, i in zip(walls, imports)):.2f} s")
    print(f"median wall {median:.2f} s (goal <= {GOAL_SECONDS:.0f} s, ratio {median / GOAL_SECONDS:.2f}); "
          f"peak RSS {peak / 1024**3:.2f} GiB (goal <= 2 GiB, ratio {peak / GOAL_RSS:.2f})")
    print("PASS" if median <= GOAL_SECONDS and peak <= GOAL_RSS else "FAIL")


if __name__ == "__main__":
    main()
