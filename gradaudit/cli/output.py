"""What every command shares on its way out: exit codes, the progress line, the files it writes
and the lines that name them, and the one-line error that ends a failed run."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import time
import traceback
from typing import Any, Callable, Optional

import click

from ..errors import ForwardError, GradauditError

# every command: 0 success, 1 a negative verdict (waste over a threshold, a step that does not fit, no
# plan that fits), 2 an error or a usage error (click's own usage errors are 2), as ruff and pytest keep them
EXIT_OK, EXIT_VERDICT, EXIT_ERROR = 0, 1, 2
EXIT_THRESHOLD = EXIT_VERDICT  # scan's name for it


class CommandFailed(Exception):
    """Ends the command with exit code 2 after printing ``message`` (one or two lines)."""

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause


class Progress:
    """One overwritten status line on stderr, only when stderr is a terminal (and not -q)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.monotonic()
        self.shown = False
        self.stream = sys.stderr  # the terminal's, also while a rank's output is being collected

    def __call__(self, step: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        line = f"gradaudit: {step}... ({elapsed:.1f}s)"
        width = shutil.get_terminal_size((80, 20)).columns - 1
        self.stream.write("\r" + line[:width].ljust(width))
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            width = shutil.get_terminal_size((80, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()
            self.shown = False


class Output:
    """Where one command's text and files go.

    The summary goes to stdout, or to stderr when the JSON document takes stdout (``--json -``). Files
    are checked for writability before the run (which can take minutes) and written after it; each
    file written, and any ``note``, becomes a line of ``announce`` in the order they came.
    """

    def __init__(self, json_path: Optional[str]) -> None:
        self.to_stderr = json_path == "-"
        self.stream = sys.stderr if self.to_stderr else sys.stdout
        self.lines: list[tuple[bool, str]] = []  # (names a file, the line)

    def echo(self, text: str) -> None:
        click.echo(text, err=self.to_stderr)

    @staticmethod
    def check(**paths: Optional[str]) -> None:
        """Fail before the run, not after it, when an output cannot be written; keywords are options
        (``memory_viz`` for ``--memory-viz``), values paths (None: not asked for; '-': stdout)."""
        for name, path in paths.items():
            if path and path != "-":
                _check_writable(path, "--" + name.replace("_", "-"))

    def write(self, path: str, content: Any, option: str, label: Optional[str] = None) -> None:
        """Write ``content`` (str, or bytes as they are) to ``path``; ``label`` names it in ``announce``."""
        try:
            if isinstance(content, bytes):
                with open(path, "wb") as handle:
                    handle.write(content)
            else:
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(content)
        except OSError as error:
            raise CommandFailed(f"cannot write {option} {path}: {error.strerror or error}; choose another path",
                                error) from error
        if label:
            self.lines.append((True, f"{label}: {path}"))

    def write_json(self, path: str, document: Any, label: Optional[str] = None) -> None:
        """``--json PATH``: ``document`` (a dict, or text already JSON) to the file, or to stdout for '-'."""
        text = document if isinstance(document, str) else json.dumps(document, indent=2)
        text = text.rstrip("\n") + "\n"
        if path == "-":
            sys.stdout.write(text)
        else:
            self.write(path, text, "--json", label)

    def note(self, line: str) -> None:
        """A line for ``announce`` that is not a file's (printed also with --quiet)."""
        self.lines.append((False, line))

    def announce(self, quiet: bool = False) -> None:
        """Print the lines naming what was written (those naming files not when ``quiet``)."""
        for names_a_file, line in self.lines:
            if not (quiet and names_a_file):
                self.echo(line)


def _check_writable(path: str, option: str) -> None:
    if os.path.isdir(path):
        raise CommandFailed(f"cannot write {option} {path}: it is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CommandFailed(f"cannot write {option} {path}: folder {folder} does not exist; create it or "
                            f"choose another path")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CommandFailed(f"cannot write {option} {path}: permission denied; choose another path")


def exit_with(run: Callable[[], int], progress: Progress, debug: bool) -> None:
    """Run a command and exit with its code; an error is one or two lines (``fail``), exit 2."""
    try:
        code = run()
    except (GradauditError, CommandFailed) as error:
        progress.done()
        message = str(error)
        if isinstance(error, ForwardError) and len(message.splitlines()) < 2:
            # (on meta, the message's second line already says what to do)
            message += ("\ncheck that the inputs (factory, --inputs or --input-shape) match what the "
                        "model's forward expects")
        fail(message, debug)
    except KeyboardInterrupt:
        progress.done()
        click.echo("gradaudit: interrupted", err=True)
        sys.exit(130)
    except Exception as error:  # a bug in gradaudit or a reporter: say so, still without a wall of text
        progress.done()
        fail(f"internal error: {type(error).__name__}: {error}\n"
             f"this is a gradaudit bug; run again with --debug and report the traceback", debug)
    sys.exit(code)


def fail(message: str, debug: bool) -> None:
    """Print ``message`` as gradaudit's error (its first two lines) and exit 2."""
    if debug:
        traceback.print_exc()
    # what failed, then what to do: each line whole, never cut; on a terminal wrapped to its width,
    # elsewhere (a log, a pipe) one line each, for grep
    lines = message.strip().splitlines() or ["failed"]
    lines = [f"gradaudit: error: {lines[0]}", *(f"  {line}" for line in lines[1:2])]
    if sys.stderr.isatty():
        width = max(60, shutil.get_terminal_size((100, 24)).columns - 1)
        lines = [wrapped for line in lines for wrapped in textwrap.wrap(
            line, width, subsequent_indent="  ", break_on_hyphens=False, drop_whitespace=False) or [line]]
    for line in lines:
        click.echo(line, err=True)
    sys.exit(EXIT_ERROR)
