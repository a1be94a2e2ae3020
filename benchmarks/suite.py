"""The run: inputs, the cases of the chosen groups with a progress bar, the report."""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import traceback
import warnings

import torch
from tqdm import tqdm

from . import GROUPS, apps, cases, compiled, half, linear, models, overhead, report
from .diagnose import diagnose
from .timing import Table


def _tasks(cfg: cases.Config, inputs: cases.Inputs, groups, threads: int, variants: dict, diagnoses: list,
           app_cfg: apps.AppConfig):
    """(group, title, thunk) for every table of the chosen groups; a thunk returns one ``Table``, or None for
    a look at the generated code (appended to ``diagnoses``)."""
    def diagnosis(title, equation, operands):
        return lambda: diagnoses.append(diagnose(title, equation, *operands()))

    def uniform_and(*shapes):  # the uniform matrix and zero dense operands (sizes are what the plan needs)
        return lambda: (inputs.uniform.scorch, *(torch.zeros(*sh(inputs.uniform.torch.shape[0])) for sh in shapes))

    out = []
    if "spmm" in groups:
        for which in ("uniform", "power-law"):
            for k in cfg.spmm_k:
                out.append(("spmm", f"SpMM, {which}, K={k}",
                            lambda which=which, k=k: cases.spmm(inputs, which, k, variants)))
        out += [("spmm", f"SpMM generated code, K={k}",
                 diagnosis(f"SpMM, K={k}", "ij,jk->ik", uniform_and(lambda n, k=k: (n, k)))) for k in cfg.spmm_k]
    if "sddmm" in groups:
        k = cfg.sddmm_k
        out += [("sddmm", f"SDDMM, {which}", lambda which=which: cases.sddmm(inputs, which))
                for which in ("uniform", "power-law")]
        out += [("sddmm", "SDDMM generated code", diagnosis(
                    f"SDDMM einsum 'ij,ik,kj->ij', K={k}", "ij,ik,kj->ij",
                    uniform_and(lambda n: (n, k), lambda n: (k, n)))),
                ("sddmm", "SDDMM generated code, B transposed", diagnosis(
                    f"SDDMM einsum 'ij,ik,jk->ij' (B stored transposed), K={k}", "ij,ik,jk->ij",
                    uniform_and(lambda n: (n, k), lambda n: (n, k))))]
    if "spmv" in groups:
        out += [("spmv", "SpMV, uniform", lambda: cases.spmv(inputs, "uniform")),
                ("spmv", "SpMV, power-law", lambda: cases.spmv(inputs, "power-law")),
                ("spmv", "SpMV generated code", diagnosis("SpMV", "ij,j->i", uniform_and(lambda n: (n,))))]
    if "spgemm" in groups:
        out.append(("spgemm", "SpGEMM", lambda: cases.spgemm(inputs)))
    if "addmul" in groups:
        out += [("addmul", f"sparse + sparse, {which}", lambda which=which: cases.add_mul(inputs, "add", which))
                for which in ("uniform", "power-law")]
        out.append(("addmul", "sparse * sparse", lambda: cases.add_mul(inputs, "mul")))
    if "chain" in groups:
        out.append(("chain", "einsum ij,jk,kl->il", lambda: cases.chain(inputs)))
    if "mttkrp" in groups:
        out.append(("mttkrp", "MTTKRP", lambda: cases.mttkrp(inputs)))
    if "real" in groups:
        out += [("real", f"SpMM, {name}, K={k}", lambda name=name, k=k: cases.real_spmm(inputs, name, k))
                for name in ("cora", "citeseer") for k in (16, 64)]
    if "scaling" in groups:
        out.append(("scaling", "SpMM time against nnz",
                    lambda: cases.spmm_nnz(inputs, app_cfg.spmm_nnz_n, app_cfg.spmm_nnz)))
    if "linear" in groups:
        n, batches = linear.size(cfg)
        out += [("linear", f"Sparse linear layer, batch {b}, {'forward + backward' if bw else 'forward'}",
                 lambda b=b, bw=bw: linear.linear_layer(cfg, n, b, bw)) for bw in (False, True) for b in batches]
        out += [("linear", f"Sparse linear layer {i} -> {o}, {tok} tokens, {'forward + backward' if bw else 'forward'}",
                 lambda o=o, i=i, tok=tok, bw=bw: linear.linear_layer(cfg, o, tok, bw, i, (4.0, 3.0), not cfg.quick))
                for o, i, tok in linear.bert_shapes(cfg) for bw in (False, True)]
        out += [("linear", f"bfloat16 linear layer {i} -> {o}, {tok} tokens",
                 lambda o=o, i=i, tok=tok: linear.bf16_layer(cfg, o, i, tok)) for o, i, tok in linear.bert_shapes(cfg)]
    if "half" in groups:
        out += [("half", f"16-bit SpMM, {which}, K={k}", lambda which=which, k=k: half.table(inputs, which, k))
                for which in ("uniform", "power-law") for k in cfg.spmm_k]
    if "gnn" in groups:
        for model in ("gcn", "sage", "gat"):
            for dataset, epochs in app_cfg.gnn_datasets + (app_cfg.gnn_big,):
                out.append(("gnn", f"{model} on {dataset}",
                            lambda m=model, d=dataset, e=epochs: apps.gnn(m, d, e, threads)))
    if "moe" in groups:
        out.append(("moe", "MoE", lambda: apps.moe(threads, cfg.quick)))
    if "recsys" in groups:
        out.append(("recsys", "recommender", lambda: apps.recsys(threads, cfg.quick)))
    if "sparsify" in groups:
        out.append(("sparsify", "sparsified MLP and transformer", lambda: apps.sparsify(threads, cfg.quick)))
    if "transformer" in groups:
        out.append(("transformer", "sparse transformer", lambda: apps.transformer(threads, cfg.quick,
                                                                                  app_cfg.seq_lens)))
    if "compile" in groups:
        out += [("compile", "GCN under torch.compile", lambda: compiled.gnn(threads, cfg.quick)),
                ("compile", "GCN under torch.compile, a generated graph",
                 lambda: compiled.gnn(threads, cfg.quick, dataset="sbm-20000")),
                ("compile", "sparse transformer under torch.compile", lambda: compiled.transformer(threads, cfg.quick)),
                ("compile", "pruned BERT under torch.compile", lambda: compiled.bert(cfg, cfg.quick))]
    if "models" in groups:
        out += [("models", title, thunk) for title, thunk in models.tasks(cfg)]
    if "overhead" in groups:
        out += [("overhead", "compile and disk-cache overhead",
                 lambda: overhead.compile_and_load(threads, cfg.compile_runs)),
                ("overhead", "per-call overhead", lambda: overhead.call_overhead(threads, cfg.quick))]
    return out


def run(args) -> int:
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # torch's beta / invariant-check notices
    torch.set_num_threads(args.threads)
    cfg = cases.QUICK if args.quick else cases.FULL
    if args.repeat is not None:
        cfg = dataclasses.replace(cfg, repeat=args.repeat, min_s=0.0)  # (exactly the rounds asked for)
    full_run = not args.quick and set(args.only) == set(GROUPS)
    out_dir = args.out or (os.path.dirname(os.path.abspath(__file__)) if full_run
                           else os.path.join(tempfile.gettempdir(), "scorch-bench"))
    machine = {"cpu": report.cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
               "load_before": report.load_average(), **report.cpu_details()}
    start = time.perf_counter()
    inputs = cases.Inputs(cfg)
    variants, diagnoses, tables, failures = {}, [], [], 0
    tasks = _tasks(cfg, inputs, args.only, args.threads, variants, diagnoses, apps.QUICK if args.quick else apps.FULL)
    with tqdm(tasks, desc="benchmarks", unit="case", dynamic_ncols=True) as bar:
        for group, title, thunk in bar:
            bar.set_postfix_str(title)
            try:
                table = thunk()
            except Exception as e:  # noqa: BLE001  (one broken case must not stop the suite)
                failures += 1
                table = Table(group, title, "(the case failed)", kind="measurements")
                table.notes.append(f"The case raised {type(e).__name__}: {e}")
                tqdm.write(f"[{title}] failed:\n{traceback.format_exc()}")
            for table in (table if isinstance(table, list) else [table] if table is not None else []):
                tables.append(table)
                tqdm.write(_summary_line(table))
    machine["load_after"] = report.load_average()
    if "bandwidth" in inputs._cache:
        machine["memory bandwidth (floors)"] = (f"{inputs.bandwidth / 1e9:.1f} GB/s (the fastest of 11 copies of a "
                                               f"{(64 if cfg.quick else 512)} MiB buffer by torch, read + write)")
    machine.update(report.versions())
    md, png = report.write(out_dir, tables, machine, variants, diagnoses, report.command_line(),
                           time.perf_counter() - start, args.quick)
    print(f"\nwrote {md}" + (f" and {png}" if png else ""))
    if args.print_table:
        print(report.summary_section(md))
    for t in tables:
        for tg in t.targets:
            print(f"  {'MET    ' if tg.met else ('NOT MET' if tg.met is False else 'n/a    ')} {t.title}: {tg.text}"
                  f" (measured {report.value_text(tg)})")
    return 1 if failures else 0


def _summary_line(t: Table) -> str:
    if t.kind != "ratios":
        parts = [f"{r.name.strip()} {report.duration(r.timing.median)}" if r.timing else f"{r.name}: {r.status}"
                 for r in t.rows]
        return f"[{t.title}] " + "; ".join(parts)
    s = t.row(t.scorch)
    if s is None or s.timing is None:
        return f"[{t.title}] scorch: {s.status if s else 'absent'}"
    others = [f"{r.name.strip()} {t.ratio(r.name):.2f}x" for r in t.rows if r.timing and r.name != t.scorch]
    return f"[{t.title}] scorch {report.ms(s.timing.median)} ms; scorch speedup over " + ", ".join(others)
