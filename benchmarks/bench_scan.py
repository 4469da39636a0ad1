"""Wall time and peak memory of `gradaudit scan` on the 80-layer, 69B-parameter Llama on meta.

Goal (issue 5): <= 15 s wall and <= 2 GiB peak RSS, writing the HTML and JSON reports.
Each run is a fresh process (imports included, as a user sees it); peak RSS comes from os.wait4's
per-child resource usage, so one run cannot hide another's peak.

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
    walls, peaks = [], []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(runs):
            wall, rss, written = one_run(folder)
            walls.append(wall)
            peaks.append(rss)
            print(f"run {i + 1}: {wall:6.2f} s wall, {rss / 1024**2:7.0f} MiB peak RSS, "
                  f"{written / 1024**2:.1f} MiB of HTML+JSON written")
    median, peak = statistics.median(walls), max(peaks)
    print(f"median wall {median:.2f} s (goal <= {GOAL_SECONDS:.0f} s, ratio {median / GOAL_SECONDS:.2f}); "
          f"peak RSS {peak / 1024**3:.2f} GiB (goal <= 2 GiB, ratio {peak / GOAL_RSS:.2f})")
    print("PASS" if median <= GOAL_SECONDS and peak <= GOAL_RSS else "FAIL")


if __name__ == "__main__":
    main()
