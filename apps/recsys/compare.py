"""Both backends in one process, epochs interleaved (scorch, torch, scorch, torch, ...), so that both see the
same machine load; prints the median epoch and test-set prediction times and the final RMSEs.

    python -m apps.recsys.compare [--epochs 60] [--threads 2] [--batches 1] [--data DIR] [--generated ...]

(``python -m apps.recsys`` runs one backend per process; on a busy machine the runs see different loads.)
"""
from __future__ import annotations

import statistics
import time

from .. import common
from . import BACKENDS, DEFAULTS, EPOCHS, Session, _check, load_data


def compare(epochs: int = EPOCHS, threads: int = 2, seed: int = 0, data=None, quiet: bool = True,
            **options) -> dict:
    _check(BACKENDS[0], epochs, options)
    common.set_threads(threads)
    dataset = load_data(data, seed, **options)
    sessions = {b: Session(b, dataset, seed, **options) for b in BACKENDS}
    times = {b: ([], []) for b in BACKENDS}
    for _ in common.progress(range(epochs), desc="recsys compare", quiet=quiet):
        for b, s in sessions.items():
            t0 = time.perf_counter()
            s.train_epoch()
            t1 = time.perf_counter()
            s.test_rmse()
            times[b][0].append(t1 - t0)
            times[b][1].append(time.perf_counter() - t1)
    out = {"data": dataset.source, "threads": threads, "epochs": epochs}
    for b, s in sessions.items():
        epoch, infer = times[b]
        out[f"{b}_epoch_s"] = statistics.median(epoch[1:] or epoch)
        out[f"{b}_infer_s"] = statistics.median(infer[1:] or infer)
        out[f"{b}_test_rmse"] = s.test_rmse()
    out["speedup"] = out["torch_epoch_s"] / out["scorch_epoch_s"]
    return out


def main(argv=None) -> dict:
    p = common.parser("recsys.compare", "Epoch and prediction times of the recsys backends, interleaved in one "
                       "process (--backend: both, always).", backends=("both",), epochs=EPOCHS)
    p.add_argument("--rank", type=int, default=DEFAULTS["rank"])
    p.add_argument("--batches", type=int, default=DEFAULTS["batches"])
    p.add_argument("--generated", action="store_true")
    args = p.parse_args(argv)
    result = compare(args.epochs, args.threads, args.seed, args.data, args.quiet, rank=args.rank,
                     batches=args.batches, generated=args.generated)
    common.report("recsys: scorch vs torch, interleaved", result)
    return result


if __name__ == "__main__":
    main()
