"""``--world-size N``: a command run once per rank, each in a fake process group as that rank
(``ranks.each_rank``), its output collected, and ranks whose output is alike printed once."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
from typing import Callable, Optional

import click

from ..errors import GradauditError
from .options import CommandOptions, assumed_gpu
from .output import CommandFailed

# a command's body: run(options, path) -> exit code, where path(p) is the name a rank writes p under
Body = Callable[[CommandOptions, Callable[[Optional[str]], Optional[str]]], int]


def run_ranked(options: CommandOptions, body: Body) -> int:
    """Run ``body(options, path)`` as it is, or with --world-size once per rank (``path`` gives each
    rank's file names). With --target-gpu/--target-torch/--target-cudnn, every run stands for that GPU."""
    with assumed_gpu(options):
        if options.world_size is None:
            if options.ranks:
                raise CommandFailed("--rank needs --world-size N (the number of ranks the factory parallelises for)")
            return body(options, lambda path: path)
        return _every_rank(options, body)


def ranked_path(path: Optional[str], rank: int) -> Optional[str]:
    """``report.html`` -> ``report.rank3.html``: with --world-size each rank writes its own files."""
    if not path or path == "-":
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class _RankProgress:
    """The command's progress line, each step prefixed with the rank it is for."""

    def __init__(self, progress: Callable[[str], None], rank: int, size: int) -> None:
        self.progress, self.prefix = progress, f"rank {rank} of {size}: "

    def __call__(self, step: str) -> None:
        self.progress(self.prefix + step)

    def done(self) -> None:
        pass  # the line stays until the last rank is done


def _every_rank(options: CommandOptions, body: Body) -> int:
    from ..ranks import alike_ranks, check_world, each_rank, rank_list

    if options.device == "cuda":
        raise CommandFailed("--world-size runs every rank in this process, in a fake process group: use --device "
                            "cpu or meta (with --target cuda for a GPU's figures)")
    try:
        size, ranks = check_world(options.world_size, list(options.ranks))
    except GradauditError as error:
        raise CommandFailed(f"--rank: {error}") from error

    def one(rank: int) -> tuple[int, str, str]:
        def path(value: Optional[str]) -> Optional[str]:
            return ranked_path(value, rank)

        ranked = dataclasses.replace(options, html=path(options.html), json=path(options.json), svg=path(options.svg),
                                     dot=path(options.dot), memory_viz=path(options.memory_viz),
                                     progress=_RankProgress(options.progress, rank, size))
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = body(ranked, path)
        except (GradauditError, CommandFailed) as error:
            raise type(error)(f"rank {rank} of {size}: {error}") from error
        return code, out.getvalue(), err.getvalue()

    runs = each_rank(size, one, ranks=ranks, device="meta" if options.device == "meta" else None)
    options.progress.done()

    def alike(rank: int, text: str) -> str:
        return text.replace(f"rank {rank} of {size}", f"rank * of {size}").replace(f".rank{rank}", ".rank*")

    groups = alike_ranks(list(runs), lambda r: (runs[r][0], alike(r, runs[r][1]), alike(r, runs[r][2])))
    if options.json == "-":  # one JSON document on stdout: each group's document under its ranks
        document = {"tool": "gradaudit", "world_size": size,
                    "groups": [{"ranks": members, "document": json.loads(runs[members[0]][1])}
                               for members in groups]}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    for members in groups:
        rank = members[0]
        _, out, err = runs[rank]
        label = (f"rank {rank} of {size}" if len(members) == 1 else
                 f"ranks {rank_list(members)} of {size} (alike: rank {rank} shown)")
        if options.json != "-" and out:
            click.echo(f"== {label} ==\n{out.rstrip()}")
        if err:
            click.echo(f"== {label} ==\n{err.rstrip()}" if options.json == "-" else err.rstrip(), err=True)
    return max(code for code, _, _ in runs.values())
