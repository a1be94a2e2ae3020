"""What every app shares: its command line, the backend's torch-like module, threads, data paths, progress,
timing and the printed summary.

An app's model code is ordinary PyTorch written against a ``torch`` module passed in as an argument: the real
``torch`` for the torch-based backends, ``scorch`` for ``--backend scorch`` (exactly ``import scorch as torch``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parser(app: str, description: str, backends: tuple, epochs: int) -> argparse.ArgumentParser:
    """The options every app takes; an app adds its own (sizes, model variant) to the parser returned."""
    p = argparse.ArgumentParser(prog=f"python -m apps.{app}", description=description)
    p.add_argument("--backend", choices=backends, default=backends[0], help=f"default {backends[0]}")
    p.add_argument("--data", default=None, help="data folder (default: $SCORCH_DATA, else ../shared/data beside "
                   "the checkout when it exists; data is generated when none is found)")
    p.add_argument("--epochs", type=int, default=epochs, help=f"training epochs (default {epochs})")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and scorch's kernels (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def to_device(obj, device):
    """``obj`` on ``device``: a tensor (a SparseTensor's every array), a module, or a dataclass or tuple of them
    (moved field by field); anything else as it is."""
    import dataclasses
    if device is None:
        return obj
    if hasattr(obj, "to") and not isinstance(obj, type):
        return obj.to(device)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple):
        return tuple(to_device(x, device) for x in obj)
    return obj


def add_device(p: argparse.ArgumentParser) -> None:
    """The ``--device`` option of the apps that run on a GPU."""
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model and data live (with the "
                   "scorch backend on a GPU, sparse ops run generated CUDA kernels); default cpu")


def add_compile(p: argparse.ArgumentParser) -> None:
    """The ``--compile`` option: the model's forward (and so its backward) under ``torch.compile``."""
    p.add_argument("--compile", action="store_true", help="run the model under torch.compile (scorch: its sparse "
                   "ops are custom ops in the graph; the first epochs compile, and are not timed)")


def compiled(module, on: bool):
    """``torch.compile(module)`` where ``on``, else ``module``: call the result, keep training ``module`` (the
    compiled module shares its parameters, ``train()`` / ``eval()``, and recompiles once for each mode)."""
    if not on:
        return module
    import torch
    return torch.compile(module)


def set_threads(threads: int) -> None:
    """OpenMP's thread count is read once, when torch loads: set it in the environment first, then in torch."""
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    torch.set_num_threads(threads)


def backend_module(backend: str):
    """``scorch`` for the scorch backend (``import scorch as torch``), else the real ``torch``."""
    if backend == "scorch":
        import scorch
        return scorch
    import torch
    return torch


def data_root(data: str | None) -> pathlib.Path | None:
    """The data folder: ``--data``, else ``$SCORCH_DATA``, else ``../shared/data`` beside the checkout; None when
    no folder was given and the default does not exist (the app then generates its data)."""
    given = data or os.environ.get("SCORCH_DATA")
    if given:
        path = pathlib.Path(given).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"data folder {str(path)!r} does not exist")
        return path
    default = ROOT.parent / "shared" / "data"
    return default if default.is_dir() else None


def progress(iterable, desc: str, quiet: bool = False, total: int | None = None):
    """A tqdm progress bar (on stderr), or the bare iterable when quiet."""
    if quiet:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


class Stopwatch:
    """Wall-clock times of repeated steps: ``with watch: ...`` records one; ``median(skip)`` leaves out the first
    ``skip`` (the warm-up steps that compile kernels)."""

    def __init__(self):
        self.times: list = []

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # GPU work is asynchronous: time it to its end
        self.times.append(time.perf_counter() - self._t0)
        return False

    def median(self, skip: int = 1) -> float:
        kept = self.times[skip:] or self.times
        return statistics.median(kept) if kept else float("nan")


def finish(steps):
    """Run a generator of steps (an app's ``training``) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def interleave(trainings: dict, block: int = 1) -> dict:
    """Step several generators of steps (name -> an app's ``training``, or a thunk making one) in turn, ``block``
    steps each a round, the order rotated every round, so that a drifting machine (another process, the clock)
    weighs on each the same; name -> the generator's return value, or the exception that stopped it. (A block of a
    few steps: a training loop's later steps find its data in the caches, as they do when it runs alone.) Each
    generator keeps its own state of torch's random generator, set before its steps and taken after them, so that
    its draws (dropout masks) are those of a run alone."""
    import torch
    live, results = {}, {}
    for name, make in trainings.items():
        try:
            live[name] = make() if callable(make) else make
        except Exception as e:  # noqa: BLE001  (a backend that cannot start is a result saying so)
            results[name] = e
    rng = {name: torch.random.get_rng_state() for name in live}
    turn = 0
    while live:
        names = list(live)
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            torch.random.set_rng_state(rng[name])
            try:
                for _ in range(block):
                    next(live[name])
            except StopIteration as done:
                results[name] = done.value
                del live[name]
            except Exception as e:  # noqa: BLE001
                results[name] = e
                del live[name]
            rng[name] = torch.random.get_rng_state()
        turn += 1
    return {name: results[name] for name in trainings}


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far: ``VmHWM`` of /proc/self/status on Linux (the mark that
    /proc/self/clear_refs resets). Not ``getrusage``'s ``ru_maxrss``: that one is inherited from the parent
    process across fork and exec, so a child started by a large process would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(title: str, result: dict) -> None:
    """Print an app's summary: one ``key: value`` line per entry; seconds as ms, fractions with 4 digits."""
    print(title)
    for key, value in result.items():
        if isinstance(value, (list, tuple, dict)):  # curves and the like: for programs, not for the summary
            continue
        if isinstance(value, float):
            if key.endswith("_s"):
                text = f"{value * 1e3:.2f} ms"
            else:
                text = f"{value:.4f}"
        else:
            text = str(value)
        print(f"  {key:<22} {text}")


def run_and_report(app: str, run, args, options) -> dict:
    """``main``'s last step: set the threads, call the app's ``run`` with the common options and the app's own
    ones (the names in ``options``, read from the parsed ``args``), print the summary, return the result."""
    set_threads(args.threads)
    result = run(args.backend, epochs=args.epochs, threads=args.threads, seed=args.seed, quiet=args.quiet,
                 data=args.data, **{k: getattr(args, k) for k in options})
    report(f"{app} ({args.backend})", result)
    return result


def init_distributed(app: str) -> tuple:
    """``(rank, world, device)`` of a ``torchrun`` launch (``--distributed``): the process group (NCCL where CUDA is
    present, each process on the GPU of its local rank; else gloo on the CPU), made once."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(f"--distributed runs under torchrun (e.g. torchrun --nproc_per_node 2 -m apps.{app} "
                               "--distributed), which sets RANK, WORLD_SIZE and the rendezvous address")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def threads_per_process(threads: int) -> int:
    """``threads``, at most this machine's cores shared by the processes ``torchrun`` started on it (more would
    oversubscribe them)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, min(threads, (os.cpu_count() or 1) // local))
