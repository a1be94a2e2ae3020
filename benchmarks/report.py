"""RESULTS.md and the speedup plot, from the tables a run produced."""
from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys

from .timing import Table, Target

MACHINE_KEYS = ("cpu", "cores", "threads", "load_before", "load_after")


# --- environment ---------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: the ISA extensions that decide which kernels run, and how fast (scorch's vector width and lead gathers; MKL's and
#: oneDNN's code paths; torch's bf16 Linear on AMX)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_details() -> dict:
    """What of the CPU a benchmark's figures depend on, for RESULTS.md beside the model name: vendor and family,
    the ISA extensions of ``ISA_FLAGS`` it has, its caches (L1d, L2 per core, L3 shared) and the kernel variant
    scorch's generated code takes on it (``compiler.target.CPU``). A speedup counts only against a peer run on the
    same CPU in the same run, and MKL's code paths differ by vendor."""
    from scorch.compiler import target
    info = target._cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = [f for f in ISA_FLAGS if f in flags]
    caches = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if not index.startswith("index"):
            continue
        try:
            with open(os.path.join(base, index, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(base, index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, index, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches.append(f"L{level}{'d' if kind == 'Data' else ''} {size.replace('K', ' KiB')}")
    from scorch.engine import amx
    cpu, tiles = target.CPU, amx.mode()
    return {"CPU vendor / family / model": " / ".join(info.get(k, "?") for k in ("vendor_id", "cpu family", "model")),
            "CPU ISA": ", ".join(isa) or "none of " + ", ".join(ISA_FLAGS),
            "CPU caches (per core, L3 shared)": ", ".join(caches) or "unknown",
            "scorch kernel variant": f"{cpu.vector_bytes}-byte vectors, lead gathers {'on' if cpu.lead_gathers else 'off'}"
                                     " (SCORCH_VECTOR_BYTES, SCORCH_LEAD_GATHERS)",
            "bfloat16 BSR on AMX tiles": "yes" if tiles == "tiles" else "the model of them (SCORCH_AMX=model)"
                                         if tiles else f"no: {amx._missing() or 'off, or failed its first-use check'}"}


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def versions() -> dict:
    import numpy
    import scipy
    import sparse
    import torch

    from scorch.compiler import runtime

    try:
        gxx = subprocess.run([runtime.compiler(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except Exception as e:  # noqa: BLE001
        gxx = f"unknown ({e})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = _git(root, "rev-parse", "--short", "HEAD")
    if commit and _git(root, "status", "--porcelain", "--", "scorch"):
        commit += " (with uncommitted changes in scorch/)"
    from . import peers
    return {"python": platform.python_version(), "torch": torch.__version__, "scipy": scipy.__version__,
            "sparse (pydata)": sparse.__version__, "numpy": numpy.__version__, **peers.versions(), "C++ compiler": gxx,
            "compiler flags": " ".join(runtime.flags()), "scorch": f"{_scorch_version()}, commit {commit or '?'}"}


def _scorch_version() -> str:
    """The installed distribution's version (``scorch.__version__`` is torch's: scorch stands in for torch)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("scorch")
    except PackageNotFoundError:
        return "unknown"


def _git(root, *args) -> str:
    try:
        run = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
        return run.stdout.strip() if run.returncode == 0 else ""
    except OSError:
        return ""


# --- formatting ------------------------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 10 else f"{ms:.1f}"


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _speedup(r: float) -> str:
    return f"{r:.2f}x" if r >= 1 else f"{r:.2f}x (scorch slower)"


def value_text(t: Target) -> str:
    if t.value is None:
        return "not measured"
    digits = 2
    while digits < 6 and (float(f"{t.value:.{digits}f}") >= t.goal if t.higher
                          else float(f"{t.value:.{digits}f}") <= t.goal) != t.met:
        digits += 1  # 1.996 against 2x is "1.996x", not a "2.00x" beside "not met"
    return f"{t.value:.{digits}f}{'x' if t.unit == 'x' else ' ' + t.unit}"


def _verdict(t: Target) -> str:
    return {True: "**met**", False: "**not met**", None: "not measured"}[t.met]


def _table_md(t: Table) -> list[str]:
    out = [f"### {t.title}", "", t.setup, ""]
    if t.kind == "app":
        out += ["| backend | training epoch ms | inference ms | quality | scorch speedup, training | scorch speedup,"
                " inference |", "| --- | ---: | ---: | --- | ---: | ---: |"]
        for r in t.rows:
            if r.timing is None:
                out.append(f"| {r.name} | {r.status} | | | | |")
                continue
            tr, ir = t.ratio(r.name), t.infer_ratio(r.name)
            ref = r.name == t.scorch
            out.append(f"| {r.name} | {ms(r.timing.median)} | {ms(r.infer.median) if r.infer else ''} | {r.metric} | "
                       f"{'(scorch)' if ref else ('' if tr is None else _speedup(tr))} | "
                       f"{'(scorch)' if ref else ('' if ir is None else _speedup(ir))} |")
    elif t.kind == "series":
        xs = sorted({x for pts in t.series.values() for x, _ in pts})
        out += [f"| {t.x_label} | " + " | ".join(t.series) + " |", "| ---: |" + " ---: |" * len(t.series)]
        for x in xs:
            cells = [next((duration(sec) for xx, sec in pts if xx == x), "") for pts in t.series.values()]
            out.append(f"| {x:,} | " + " | ".join(cells) + " |")
    elif t.kind == "measurements":
        out += ["| measurement | median | min | runs |", "| --- | ---: | ---: | ---: |"]
        for r in t.rows:
            if r.timing is None:
                out.append(f"| {r.name} | {r.status} | | |")
            else:
                out.append(f"| {r.name} | {duration(r.timing.median)} | {duration(r.timing.min)} | {r.timing.runs} |")
    else:
        out += ["| implementation | median ms | min ms | runs | scorch speedup (its time / scorch's) |",
                "| --- | ---: | ---: | ---: | ---: |"]
        for r in t.rows:
            if r.timing is None:
                out.append(f"| {r.name} | {r.status} | | | |")
                continue
            ratio = t.ratio(r.name)
            cell = "(reference: scorch)" if r.name == t.scorch else ("" if ratio is None else _speedup(ratio))
            out.append(f"| {r.name} | {ms(r.timing.median)} | {ms(r.timing.min)} | {r.timing.runs} | {cell} |")
    out.append("")
    best, s = t.best_anchor(), t.row(t.scorch)
    if t.anchors:
        out.append(f"- Anchors: {', '.join(t.anchors)}; the fastest that ran: "
                   + (f"{best.name} ({ms(best.timing.median)} ms)." if best else "none."))
    if t.floor_s:
        out.append(f"- Memory floor: {t.floor_bytes / 1e6:.2f} MB must move (operands read once, result written "
                   f"once), {ms(t.floor_s)} ms at the measured bandwidth"
                   + (f"; scorch takes {s.timing.median / t.floor_s:.1f}x that." if s and s.timing else "."))
    for tg in t.targets:
        line = f"- Target: {tg.text}: measured {value_text(tg)}, {_verdict(tg)}."
        if tg.value is None and tg.why_missing:
            line += f" ({tg.why_missing})"
        out.append(line)
    out += [f"- {n}" for n in t.notes]
    out.append("")
    return out


def _anchor_section(tables: list) -> list[str]:
    """The kernel table: scorch against the best anchor and the memory floor, one row per case with anchors."""
    rows = [t for t in tables if t.kind == "ratios" and t.anchors]
    if not rows:
        return []
    out = ["", "## Kernels: scorch against the best anchor and the memory floor", "",
           "The best anchor is the fastest of the case's torch, scipy, Intel MKL (`sparse-dot-mkl`) and "
           "SuiteSparse:GraphBLAS (`python-graphblas`) rows that ran and passed the check (an anchor whose package is"
           " missing shows as not installed in the case's table). The floor is the bytes that must move at least "
           "once (operands read, result written; float32 values, int32 indices) over the measured copy bandwidth "
           "(see Machine); scorch / floor is how many times the floor scorch's median takes. The kernel cases alone: "
           "`python -m benchmarks --only kernels` (written under `$TMPDIR/scorch-bench/` unless `--out` is given).", "",
           "| case | scorch ms | best anchor | anchor ms | scorch speedup vs best anchor | floor ms | scorch / floor |"
           " anchors not timed |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for t in rows:
        s, best = t.row(t.scorch), t.best_anchor()
        sc = ms(s.timing.median) if s and s.timing else (s.status if s else "")
        speed = _speedup(best.timing.median / s.timing.median) if best and s and s.timing else ""
        over = f"{s.timing.median / t.floor_s:.1f}x" if t.floor_s and s and s.timing else ""
        missing = [f"{n.split()[0]} ({_short_status(t.row(n).status if t.row(n) else 'absent')})" for n in t.anchors
                   if t.row(n) is None or t.row(n).timing is None]
        out.append(f"| {t.title} | {sc} | {best.name if best else 'none'} | {ms(best.timing.median) if best else ''} | "
                   f"{speed} | {ms(t.floor_s) if t.floor_s else ''} | {over} | {', '.join(missing)} |")
    return out


def _short_status(status: str) -> str:
    return status.split(" (", 1)[0] if status.startswith(("not installed", "not supported")) else status[:60]


# --- the SpMM story: generated loop vs hand kernel ---------------------------------------------------------------

def _spmm_analysis(tables, variants, diagnoses) -> list[str]:
    out = []
    for t in tables:
        if t.group != "spmm" or t.title not in variants:
            continue
        v = variants[t.title]
        scorch_row, hand_row, torch_row = t.row(t.scorch), _hand_row(t), t.row(t.torch)
        if not (scorch_row and scorch_row.timing and hand_row and hand_row.timing):
            continue
        s, h = scorch_row.timing.median, hand_row.timing.median
        parts = [f"**{t.title}**: scorch {ms(s)} ms, hand kernel {ms(h)} ms ({s / h:.2f}x)."]
        rmw, wide = v.get("ablation spmm_gen_rmw"), v.get("ablation spmm_gen_rmw (512-bit)")
        acc, accw = v.get("ablation spmm_gen_acc"), v.get("ablation spmm_gen_acc (512-bit)")
        nojam, nojamw = (v.get("ablation spmm_gen_acc (no unroll-and-jam)"),
                         v.get("ablation spmm_gen_acc (no unroll-and-jam, 512-bit)"))
        if rmw:
            parts.append(f"By hand, the loop that updates the output row in memory for every nonzero "
                         f"(`out[i, :] +=`) takes {ms(rmw)} ms" + (f", {ms(wide)} ms with 512-bit vectors" if wide else "")
                         + ".")
        if acc:
            parts.append(f"The row accumulated in a local `float acc[K]` and stored once (a row workspace): {ms(acc)} ms"
                         + (f" ({ms(accw)} ms with 512-bit vectors)" if accw else "")
                         + (f"; without GCC's unroll-and-jam pass, which turns it into gathers: {ms(nojam)} ms"
                            if nojam else "")
                         + (f" ({ms(nojamw)} ms with 512-bit vectors)" if nojamw else "") + ".")
        form = _generated_form(diagnoses, t.title)
        if form:
            parts.append(f"scorch's generated kernel for this K uses {form} (its hot loop is below).")
        parts.append("The hand kernel keeps the output row in vector registers across the row's nonzeros (GCC "
                     "vector types, `benchmarks/kernels/spmm.cpp`).")
        if torch_row and torch_row.timing:
            parts.append(f"The hand kernel is {torch_row.timing.median / h:.2f}x faster than torch CSR here.")
        out += [" ".join(parts), ""]
    for d in diagnoses:
        out += [f"**Generated hot loop, {d.title}** (from `scorch.explain`):", ""]
        if d.plan:
            out += ["Plan: " + "; ".join(f"`{p}`" for p in d.plan), ""]
        if d.hot_loop:
            out += ["```cpp", d.hot_loop, "```", ""]
        if d.error:
            out += [f"({d.error})", ""]
        if d.vectorizer:
            out += ["GCC (`-fopt-info-vec-all`, scorch's flags) on these lines:", ""]
            out += [f"- {r}" for r in d.vectorizer] + [""]
        out += [f"- {f}" for f in d.findings] + [""]
    return out


def _generated_form(diagnoses, title: str) -> str:
    """Which of the ablation forms the generated SpMM kernel for the table's K has, from its hot loop."""
    k = title.rsplit("K=", 1)[-1]
    d = next((d for d in diagnoses if d.title == f"SpMM, K={k}"), None)
    if d is None or not d.hot_loop:
        return ""
    if re.search(r"^\s*float \w+\[\d+\];", d.hot_loop, flags=re.M):
        return "the local-array form"
    if re.search(r"\bout\[[^;]*\] \+=", d.hot_loop):
        return "the update-in-memory form"
    return "neither form"


def _hand_row(t: Table):
    return next((r for r in t.rows if r.name.startswith("hand C++")), None)


def _variants_md(variants: dict) -> list[str]:
    if not variants:
        return []
    titles = list(variants)
    names = []
    for v in variants.values():
        names += [n for n in v if n not in names]
    out = ["| variant | " + " | ".join(titles) + " |", "| --- |" + " ---: |" * len(titles)]
    for n in names:
        cells = []
        for title in titles:
            sec = variants[title].get(n)
            best = min((x for k, x in variants[title].items() if k.startswith("hand ")), default=None)
            cells.append("" if sec is None else ms(sec) + (" **(best)**" if sec == best else ""))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return out + [""]


# --- the whole file --------------------------------------------------------------------------------------------

def write(directory: str, tables: list, machine: dict, variants: dict, diagnoses: list, command: str,
          elapsed: float, quick: bool) -> tuple[str, str]:
    os.makedirs(os.path.join(directory, "plots"), exist_ok=True)
    md = os.path.join(directory, "RESULTS.md")
    plots = _plots(tables, os.path.join(directory, "plots"))
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = ["# Benchmark results", "",
             f"Produced by `{command}` on {now}, in "
             + (f"{elapsed / 60:.1f} min" if elapsed >= 120 else f"{elapsed:.0f} s")
             + (" (**quick mode: small sizes, not the issue's cases**)" if quick else "") + ".",
             "Times are the median of repeated calls after warm-up (the first call, which compiles, is excluded); "
             "peers of a case run in the same process, interleaved round by round. Ratios are medians divided by "
             "scorch's median: above 1, scorch is faster.", "",
             "## Machine", "",
             f"- CPU: {machine['cpu']}, {machine['cores']} logical cores; threads used: {machine['threads']} "
             "(torch.set_num_threads, OMP_NUM_THREADS)",
             f"- load average (1 / 5 / 15 min) before the run: {machine['load_before']}; after: "
             f"{machine['load_after']} (a load above the thread count means other processes competed for the cores"
             " and the medians carry their noise; the min column is the least disturbed run)"]
    lines += [f"- {k}: {v}" for k, v in machine.items() if k not in MACHINE_KEYS]
    lines += ["", "## Summary", "",
              "| case | scorch ms | torch ms | scorch speedup vs torch |", "| --- | ---: | ---: | ---: |"]
    for t in tables:
        if t.kind not in ("ratios", "app"):
            continue
        s, tr = t.row(t.scorch), t.row(t.torch)
        sc = ms(s.timing.median) if s and s.timing else (s.status if s else "")
        tc = ms(tr.timing.median) if tr and tr.timing else (tr.status if tr else "")
        r = t.ratio(t.torch)
        lines.append(f"| {t.title} | {sc} | {tc} | {'' if r is None else _speedup(r)} |")
    lines += _anchor_section(tables)
    lines += ["", "## Targets", "", "| case | target | measured | |", "| --- | --- | ---: | --- |"]
    for t in tables:
        for tg in t.targets:
            lines.append(f"| {t.title} | {tg.text} | {value_text(tg)} | {_verdict(tg)} |")
    missed = [(t, tg) for t in tables for tg in t.targets if tg.met is False]
    if missed:
        lines += ["", "Where a target is not met, the case's section and *Generated kernels* below say what the "
                      "measurements and the generated source show."]
    lines += ["", "## Cases", ""]
    for t in tables:
        lines += _table_md(t)
    if variants:
        lines += ["## SpMM: hand-kernel variants and the generated loop", "",
                  "Median ms over a short trial on each case. `hand ...` are the yardstick candidates, built with "
                  "scorch's flags (the fastest is the case's hand kernel); `ablation ...` are the loops scorch "
                  "generates, written by hand (`benchmarks/kernels/spmm.cpp`): `spmm_gen_rmw` updates the output row"
                  " in memory per nonzero, `spmm_gen_acc` accumulates it in a local array. Their options are set by "
                  "pragmas, whatever scorch's flags: no suffix is GCC 12's -O3 default here (256-bit vectors "
                  "preferred, loop unroll-and-jam on).", ""]
        lines += _variants_md(variants)
    analysis = _spmm_analysis(tables, variants, diagnoses)
    if analysis:
        lines += ["## Generated kernels: what the measurements and the source show", ""] + analysis
    if plots:
        lines += ["## Plots", ""] + [f"![{title}](plots/{os.path.basename(path)})" for title, path in plots] + [""]
    gpu = gpu_sections(md)
    with open(md, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n" + ("\n" + gpu if gpu else ""))
    return md, ", ".join(path for _, path in plots)


def gpu_sections(md: str) -> str:
    """The ``## GPU: ...`` sections of the RESULTS.md at ``md`` (``python -m benchmarks.gpu --write`` appends them on a
    machine with a GPU, which a CPU run does not have): a CPU run's rewrite keeps them, each to the next ``## ``."""
    try:
        with open(md) as f:
            text = f.read()
    except OSError:
        return ""
    keep, out = False, []
    for line in text.splitlines():
        if line.startswith("## "):
            keep = line.startswith("## GPU:")
        if keep:
            out.append(line)
    return "\n".join(out).rstrip() + "\n" if out else ""


def _plots(tables: list, directory: str) -> list:
    """Every plot the tables allow, as (title, path): kernel speedups, app speedups, and one per series."""
    out = []
    kernels = [t for t in tables if t.kind == "ratios"]
    if plot(kernels, os.path.join(directory, "kernels.png")):
        out.append(("kernel speedups vs torch", os.path.join(directory, "kernels.png")))
    anchored = [t for t in kernels if t.anchors]
    if plot_anchors(anchored, os.path.join(directory, "floor.png")):
        out.append(("kernels: scorch / memory floor and speedup vs the best anchor", os.path.join(directory, "floor.png")))
    apps = [t for t in tables if t.kind == "app"]
    if plot_apps(apps, os.path.join(directory, "apps.png")):
        out.append(("app speedups", os.path.join(directory, "apps.png")))
    for t in tables:
        if t.kind == "series" and t.series:
            path = os.path.join(directory, re.sub(r"[^a-z0-9]+", "_", t.title.lower()).strip("_") + ".png")
            plot_series(t, path)
            out.append((t.title, path))
    return out


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_apps(tables: list, path: str) -> bool:
    """Grouped bars: scorch's training-epoch speedup over each other backend, per app case (log scale)."""
    cases = [(t, [r for r in t.rows if r.name != t.scorch and t.ratio(r.name) is not None]) for t in tables]
    cases = [(t, rows) for t, rows in cases if rows]
    if not cases:
        return False
    plt = _pyplot()
    peers = []
    for _, rows in cases:
        peers += [r.name for r in rows if r.name not in peers]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases) + 3), 5.5))
    width = 0.8 / len(peers)
    for k, peer in enumerate(peers):
        pts = [(x, t.ratio(peer)) for x, (t, _) in enumerate(cases) if t.ratio(peer) is not None]
        xs = [x - 0.4 + width * (k + 0.5) for x, _ in pts]
        ax.bar(xs, [r for _, r in pts], width=width, label=f"vs {peer}")
        for x, (_, r) in zip(xs, pts):
            ax.annotate(f"{r:.2f}x", (x, r), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.set_ylabel("scorch speedup per training epoch (peer time / scorch time)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([t.title.replace(", ", "\n") for t, _ in cases], rotation=30, ha="right", fontsize=8)
    ax.set_title("apps: scorch against the other backends (above 1: scorch faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_anchors(tables: list, path: str) -> bool:
    """Two panels per kernel case: scorch's time over the memory floor (with the 3x line), and scorch's speedup
    over the best anchor (its name on the bar, the case's anchor target as a tick). Log scales."""
    cases = []
    for t in tables:
        s, best = t.row(t.scorch), t.best_anchor()
        if s is None or s.timing is None:
            continue
        floor = s.timing.median / t.floor_s if t.floor_s else None
        speed = best.timing.median / s.timing.median if best else None
        goal = next((tg.goal for tg in t.targets if "best anchor" in tg.text), None)
        cases.append((t.title, floor, speed, best.name.split()[0] if best else "", goal))
    if not cases:
        return False
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(9, 0.8 * len(cases) + 3), 9), sharex=True)
    xs = list(range(len(cases)))
    fl = [(x, c[1]) for x, c in zip(xs, cases) if c[1] is not None]
    top.bar([x for x, _ in fl], [v for _, v in fl], color=["tab:green" if v <= 3 else "tab:orange" for _, v in fl])
    for x, v in fl:
        top.annotate(f"{v:.1f}x", (x, v), ha="center", va="bottom", fontsize=8)
    top.axhline(1.0, color="black", linewidth=0.8)
    top.axhline(3.0, color="black", linestyle=":", linewidth=1.2, label="3x the floor (target for SpMV, SpMM, SDDMM)")
    top.set_yscale("log")
    top.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    top.set_ylabel("scorch time / memory floor (log)")
    top.set_title("scorch against the memory floor (1x: every byte moved once at copy speed)")
    top.legend(fontsize=8)
    sp = [(x, c[2], c[3]) for x, c in zip(xs, cases) if c[2] is not None]
    bottom.bar([x for x, _, _ in sp], [v for _, v, _ in sp], color=["tab:green" if v >= 1 else "tab:red" for _, v, _ in sp])
    for x, v, name in sp:
        bottom.annotate(f"{v:.2f}x\nvs {name}", (x, v), ha="center", va="bottom", fontsize=7)
    for x, c in zip(xs, cases):
        if c[4] is not None:
            bottom.plot([x - 0.4, x + 0.4], [c[4], c[4]], color="black", linestyle=":", linewidth=1.5)
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_yscale("log")
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    bottom.set_ylabel("scorch speedup over the best anchor (log)")
    bottom.set_title("scorch vs the fastest of torch, scipy, MKL, GraphBLAS (dotted: target)")
    bottom.set_xticks(xs)
    bottom.set_xticklabels([c[0].replace(", ", "\n") for c in cases], rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_series(t: Table, path: str) -> None:
    """Time against a size, one line per peer, log-log."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, pts in t.series.items():
        pts = sorted(pts)
        ax.plot([x for x, _ in pts], [sec * 1e3 for _, sec in pts], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(t.x_label)
    ax.set_ylabel("median time, ms (log)")
    ax.set_title(t.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(tables: list, path: str) -> bool:
    """Bar chart of scorch's speedup over torch per case (log scale), with the hand kernel's where there is one
    and the targets as ticks. Returns False if nothing could be plotted."""
    bars = []
    for t in tables:
        r = t.ratio(t.torch) if t.kind == "ratios" else None
        if r is None:
            continue
        hand = _hand_row(t)
        h = t.ratio(t.torch, hand.name) if hand else None
        goal = next((tg.goal for tg in t.targets if "torch" in tg.text and tg.higher), None)
        bars.append((t.title, r, h, goal))
    if not bars:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(bars) + 3), 5.5))
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[1] for b in bars], width=0.4, label="scorch",
           color=["tab:green" if b[1] >= 1 else "tab:red" for b in bars])
    hx = [(x, b[2]) for x, b in zip(xs, bars) if b[2] is not None]
    if hx:
        ax.bar([x + 0.2 for x, _ in hx], [h for _, h in hx], width=0.4, label="hand C++ kernel", color="tab:gray")
    for x, b in zip(xs, bars):
        if b[3] is not None:
            ax.plot([x - 0.4, x + 0.4], [b[3], b[3]], color="black", linestyle=":", linewidth=1.5)
        ax.annotate(f"{b[1]:.2f}x", (x - 0.2, b[1]), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}x" if str(f"{y:g}")[0] in "2357" else ""))
    ax.set_ylabel("speedup over torch (torch time / time), log scale")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([b[0].replace(", ", "\n") for b in bars], rotation=30, ha="right", fontsize=8)
    ax.set_title("scorch vs torch (dotted: target)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summary_section(md: str) -> str:
    """The *Summary* and *Targets* sections of a written RESULTS.md, as they stand in the file."""
    with open(md) as f:
        text = f.read()
    start = text.find("## Summary")
    end = text.find("## Cases")
    return text[start:end].rstrip() if start >= 0 else ""


def command_line() -> str:
    return " ".join(["python -m benchmarks"] + sys.argv[1:])
