"""A real multi-process run on this machine: ``world_size`` processes joined by the gloo backend on
loopback, each measuring its rank with gradaudit.measure (the project's independent tracker).

``run_world("distributed_models:llama_fsdp2", 2)`` starts one worker process per rank (this file,
run by ``sys.executable``) with RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set. The
rendezvous store is served by this (the parent) process on a port the system picked, so no port is
guessed and raced for; each worker joins it as a client and builds a gloo process group on it
(GLOO_SOCKET_IFNAME=lo on Linux: loopback only). ``run_worlds`` measures several builders in one
world (the processes start once: importing torch and transformers is most of a small world's
time); ``World`` starts one in the background and ``World.result()`` collects it.

Each rank then, with ``torch.set_num_threads(1)`` and ``torch.manual_seed(0)`` (``measure_rank``):

- builds ``builder(rank, world_size) -> (model, inputs)`` ("module:function", importable from
  tests/ or the repository) and measures ``measure.held_bytes_after_forward(model, inputs)``;
- builds it afresh (seeded again) and measures ``measure.forward_backward(model, args, kwargs)``.

A fresh model for each, not the same one: ``held_bytes_after_forward`` runs a forward and no
backward, which leaves FSDP2 in the middle of an iteration (the root's gathered parameters still
registered, its post-backward callback never run), a state no training loop starts a step from.
Each builds in milliseconds.

Every rank writes a JSON of its figures (bytes): ``held`` (held_bytes_after_forward),
``forward_backward_held`` and ``peak`` (forward_backward), ``parameter_bytes`` (this rank's local
parameter storages, counted once each, before the forward), ``step_peak`` (measured_step_peak: one
steady-state training step with AdamW, on a third fresh model); with DistributedDataParallel,
``step_peak_accumulated`` (a step of two micro-batches, the first under ``no_sync``), and every model
given ``measure.record_buckets`` (the real all-reduce in a gloo world, none in a fake one). A builder
that returns a pipeline schedule (``(schedule, this rank's step inputs)``) gets ``parameter_bytes`` and
``step_peak`` only (``measured_schedule_step_peak``: its whole step, every micro-batch, then AdamW's). The parent returns
``{rank: figures}``; a rank that fails, or a world that runs past ``timeout`` seconds, raises
WorldError with every rank's output, after the stragglers are killed.

``fake_rank(rank, world_size)`` is the other side of the comparison: this process as one rank of
PyTorch's fake process group, where ``measure_rank`` gives the figures a one-process audit sees.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


class WorldError(RuntimeError):
    """A rank failed or the world ran past its time; the message carries every rank's output.
    ``results``: the figures of the builders that every rank finished before, {builder: {rank: figures}}."""

    def __init__(self, message: str, results: dict[str, dict[int, dict]]) -> None:
        super().__init__(message)
        self.results = results


def run_world(builder: str, world_size: int, *, timeout: float = 180) -> dict[int, dict]:
    """Run ``builder`` ("module:function") on ``world_size`` real gloo processes; {rank: figures}."""
    return World([builder], world_size, timeout=timeout).result()[builder]


def run_worlds(builders: list[str], world_size: int, *, timeout: float = 180) -> dict[str, dict[int, dict]]:
    """Several builders, one after another in the same processes and process group (each process
    starts once: importing torch and transformers is most of a small world's time); {builder: {rank:
    figures}}."""
    return World(builders, world_size, timeout=timeout).result()


class World:
    """A real world started in the background: ``World(builders, n)`` starts its processes and returns
    at once (the caller may do other work meanwhile); ``result()`` waits for them, at most ``timeout``
    seconds from the start, and returns {builder: {rank: figures}}, or kills them and raises
    WorldError (which keeps the figures of the builders every rank finished before)."""

    def __init__(self, builders: list[str], world_size: int, *, timeout: float = 180) -> None:
        import torch.distributed as dist

        self.builders = list(builders)
        for builder in self.builders:
            if ":" not in builder or "," in builder:
                raise ValueError(f"builder must be 'module:function', not {builder!r}")
        self.world_size, self.timeout = world_size, timeout
        self.deadline = time.monotonic() + timeout
        # the rendezvous store, served here on a port the system picks (none is guessed and raced for)
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self._tmp = tempfile.TemporaryDirectory(prefix="gloo_world_")
        self.out = Path(self._tmp.name)
        env = dict(os.environ)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), WORLD_SIZE=str(world_size),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), str(ROOT), env.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL=env.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
        if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the host name resolves to
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                with open(self.out / f"rank{rank}.err", "wb") as err:  # the child keeps its own handle
                    self.procs.append(subprocess.Popen(
                        [sys.executable, __file__, ",".join(self.builders), str(self.out), str(timeout)],
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, cwd=str(ROOT)))
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()

    def kill(self) -> None:
        """Kill the ranks still running (a rank left waiting on a collective of a dead one) and clean up."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._tmp.cleanup()
        self.store = None  # stops serving the rendezvous

    def result(self) -> dict[str, dict[int, dict]]:
        name = f"{', '.join(self.builders)} on a world of {self.world_size}"
        try:
            failed = None
            while True:
                codes = [proc.poll() for proc in self.procs]
                failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
                if failed is not None or all(code == 0 for code in codes) or time.monotonic() > self.deadline:
                    break
                time.sleep(0.05)
            running = [rank for rank, proc in enumerate(self.procs) if proc.poll() is None]
            results = self._collect()
            if failed is not None:
                why = f"rank {failed} exited with status {self.procs[failed].returncode}"
            elif running:
                why = f"ranks {running} still running after {self.timeout:g} s (killed)"
            elif len(results) < len(self.builders):
                why = "a rank exited without writing all its figures"
            else:
                return results
            raise WorldError(f"{name}: {why}\n" + _stderr(self.out, self.world_size), results)
        finally:
            self.kill()

    def _collect(self) -> dict[str, dict[int, dict]]:
        """The figures of the builders every rank finished, {builder: {rank: figures}}, in order."""
        by_rank = {}
        for rank in range(self.world_size):
            path = self.out / f"rank{rank}.json"
            by_rank[rank] = json.loads(path.read_text()) if path.exists() else {}
        return {builder: {rank: by_rank[rank][builder] for rank in by_rank} for builder in self.builders
                if all(builder in figures for figures in by_rank.values())}


def _stderr(out: Path, world_size: int, tail: int = 6000) -> str:
    parts = []
    for rank in range(world_size):
        path = out / f"rank{rank}.err"
        text = path.read_text(errors="replace") if path.exists() else ""
        parts.append(f"--- rank {rank} stderr ---\n{text[-tail:]}")
    return "\n".join(parts)


def resolve(builder: str) -> Any:
    """"module:function" -> the function (the module imported from tests/ or the repository)."""
    module, _, name = builder.partition(":")
    return getattr(importlib.import_module(module), name)


# In a real gloo run a collective's tensors are released by gloo's own worker thread once it is done
# with them, which on a loaded machine can be after this rank has moved on: a measurement taken then
# counts them too (seen once in a full CI-like run: llama_tp_sp's rank 1 held 3 * 8192 bytes more in
# forward_backward). Such a straggler only ever adds bytes, so each figure is the least of a few runs
# (every run on a freshly built model): two, and a third where the two differ in any figure (a
# straggler in one of them; on any rank: every rank runs as many); the fake group completes every
# collective on the spot.
RUNS = 2
MORE_RUNS = 1  # where the RUNS runs disagree


def measure_rank(builder: Any, rank: int, world_size: int, runs: int = RUNS, steps: bool = True) -> dict[str, int]:
    """This rank's figures, in whatever process group is initialised (a real one or a fake one): each
    the least of ``runs`` measurements, and of ``MORE_RUNS`` more where those disagree (see above;
    one does in a fake group). ``steps``: the training steps' peaks too (``step_peak``,
    ``step_peak_accumulated``), the costliest figures."""
    measured = [_measure_once(builder, rank, world_size, steps) for _ in range(runs)]
    if runs > 1 and _anywhere(any(run != measured[0] for run in measured[1:])):  # every rank runs as many
        measured += [_measure_once(builder, rank, world_size, steps) for _ in range(MORE_RUNS)]
    return {key: min(run[key] for run in measured) for key in measured[0]}


def _anywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the initialised process group (an all-reduce)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _measure_once(builder: Any, rank: int, world_size: int, steps: bool = True) -> dict[str, int]:
    import torch

    from gradaudit import measure
    from gradaudit.tensors import split_inputs

    torch.manual_seed(0)
    model, inputs = builder(rank, world_size)
    if hasattr(model, "_stage") or hasattr(model, "_stages"):  # a pipeline schedule: its whole step
        modules = [stage.submod for stage in getattr(model, "_stages", None) or [model._stage]]
        parameter_bytes = sum(measure.current_nbytes(key) for key in measure.storage_keys(
            p for module in modules for p in module.parameters()))
        step_peak = measure.measured_schedule_step_peak(model, inputs, lambda params: torch.optim.AdamW(params))
        return {"parameter_bytes": parameter_bytes, "step_peak": step_peak}
    parameter_bytes = sum(measure.current_nbytes(key) for key in measure.storage_keys(model.parameters()))
    held = measure.held_bytes_after_forward(model, inputs)
    del model, inputs
    torch.manual_seed(0)
    model, inputs = builder(rank, world_size)
    measure.record_buckets(model)  # in a fake world, DDP's backward needs a hook (measure's own)
    args, kwargs = split_inputs(inputs)
    fb_held, peak = measure.forward_backward(model, args, kwargs)
    del model, inputs, args, kwargs
    figures = {"held": held, "forward_backward_held": fb_held, "peak": peak, "parameter_bytes": parameter_bytes}
    if not steps:
        return figures
    torch.manual_seed(0)
    model, inputs = builder(rank, world_size)
    measure.record_buckets(model)  # DDP's buckets, alive throughout (none without DDP)
    # one steady-state training step with AdamW (defaults), the model's own loss or its output's sum
    step_peak = measure.measured_step_peak(model, inputs, lambda params: torch.optim.AdamW(params), step_loss)
    figures["step_peak"] = step_peak
    if measure.data_parallel_modules(model):  # DDP: also a step of two micro-batches, the first under no_sync
        del model, inputs
        torch.manual_seed(0)
        model, inputs = builder(rank, world_size)
        measure.record_buckets(model)
        figures["step_peak_accumulated"] = measure.measured_step_peak(
            model, inputs, lambda params: torch.optim.AdamW(params), step_loss, accumulation=2)
    return figures


def step_loss(output: Any) -> Any:
    """The loss a training loop takes: a Hugging Face output's ``loss``, else the output summed."""
    loss = getattr(output, "loss", None)
    return loss if loss is not None else output.sum()


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` in PyTorch's fake process group (every collective
    a no-op of the right shapes), for the block; the group is destroyed afterwards.

    DTensor's caches are cleared on the way in and out: a DeviceMesh compares equal to the same
    layout in a later process group, so a sharding or redistribution plan cached under one group
    would send the next one's collectives to subgroups that no longer exist ("Could not resolve
    the process group registered under the name 3" on the third rank of a 2-D mesh)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]: " and never unwraps it
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()
        sys.excepthook = hook


def _clear_dtensor_caches() -> None:
    from gradaudit.torchapi.distributed import clear_dtensor_caches  # (the caches, not a measurement: shared)

    clear_dtensor_caches()


def _worker(builders: str, out: str, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    results = {}
    try:
        for builder in builders.split(","):
            figures = measure_rank(resolve(builder), rank, world_size)
            figures.update(rank=rank, world_size=world_size, backend=dist.get_backend())
            results[builder] = figures
            tmp = Path(out) / f"rank{rank}.json.tmp"  # written after each builder: a later failure keeps them
            tmp.write_text(json.dumps(results))
            tmp.rename(Path(out) / f"rank{rank}.json")
            dist.barrier()  # every rank done with this model before the next is built
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], float(sys.argv[3]))
