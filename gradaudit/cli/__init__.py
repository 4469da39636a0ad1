"""The ``gradaudit`` command line: ``scan`` a model factory, ``plan`` its checkpointing for a memory
budget, ``fit`` a whole training step in a device's memory, list ``rules``, ``explain`` one rule.

One module per command (``scan``, ``plan``, ``fit``, ``rules``); what they share on the way in is in
``options`` (the model options, building the model), on the way out in ``output`` (files, exit codes,
errors), and ``ranked`` runs a command once per rank for ``--world-size``. Only this package prints or
writes files; everything it shows comes from the library's results and the reporters. The commands
import torch and the library inside their run functions, so ``--help`` stays instant.
"""

from __future__ import annotations

from typing import Optional, Sequence

import click

from .fit import fit_command
from .options import CommandOptions
from .output import EXIT_ERROR, EXIT_OK, EXIT_THRESHOLD, EXIT_VERDICT, CommandFailed, Progress, fail
from .plan import plan_command
from .rules import explain, rules_command
from .scan import run_scan, scan

EXIT_CODES_HELP = """\b
Exit codes (every command; each one's --help says what its own mean):
  0  success
  1  a negative verdict: scan's waste over a threshold, a fit that does
     not fit and has no remedy, a budget that no plan fits
  2  an error or a usage error (one or two lines on stderr; --debug
     for the traceback)
"""

__all__ = ["cli", "main", "CommandOptions", "CommandFailed", "Progress", "run_scan", "fail",
           "EXIT_OK", "EXIT_VERDICT", "EXIT_THRESHOLD", "EXIT_ERROR"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=EXIT_CODES_HELP)
@click.version_option(package_name="gradaudit", prog_name="gradaudit")
def cli() -> None:
    """Find the memory PyTorch autograd holds for backward that backward can never use."""


for _command in (scan, plan_command, fit_command, rules_command, explain):
    cli.add_command(_command)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point (also ``python -m gradaudit``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="gradaudit")
