"""trim's held and peak bytes on the trim benchmark's models and scenarios, and whether every trimmed
gradient is bit-identical to the plain one, as JSON: run it under two torch releases and compare the
files (torch 2.11-2.13 have no node-creation hook, where trim finds nodes by a graph walk).

    python benchmarks/trim_across_releases.py trim-2.14.json
    venv-2.11/bin/python benchmarks/trim_across_releases.py trim-2.11.json
    python -c "import json,sys; print(json.load(open(sys.argv[1])) == json.load(open(sys.argv[2])))" \\
        trim-2.14.json trim-2.11.json
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys

import torch
import torchvision

from gradaudit.scenarios import SCENARIOS, apply_scenario
from gradaudit.trimming import compare, trim

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_trim import MODELS  # noqa: E402
from test_trim import assert_identical, gradients  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}", flush=True)
    figures = {}
    for label, name in MODELS.items():
        for scenario in SCENARIOS:
            torch.manual_seed(0)
            model = getattr(torchvision.models, name)(num_classes=10)
            x = torch.randn(2, 3, 64, 64)
            apply_scenario(model, scenario, x)
            measured = compare(model, x)
            state = copy.deepcopy(model.state_dict())
            plain = gradients(model, (x,))
            model.load_state_dict(state)
            with trim(model):
                trimmed = gradients(model, (x,))
            assert_identical(plain, trimmed)  # raises where a gradient differs by a bit
            figures[f"{label} / {scenario}"] = measured
            print(f"{label:<16} {scenario:<20} {measured}  gradients bit-identical", flush=True)
    pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "trim-figures.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
