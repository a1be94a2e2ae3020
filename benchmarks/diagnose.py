"""What the generated kernel looks like: its hot loop (from ``scorch.explain``) and what GCC's vectorizer did
with it (``-fopt-info-vec``, same compiler and flags as scorch's runtime)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

import scorch
from scorch.compiler import runtime

from .cases import sources_of


@dataclass
class Diagnosis:
    title: str
    plan: list = field(default_factory=list)     # explain's lines on how the work is split (contraction, steps)
    hot_loop: str = ""                           # the innermost loop and its parent, as generated
    vectorizer: list = field(default_factory=list)  # GCC's remarks on the hot loop's lines
    findings: list = field(default_factory=list)    # plain-language facts drawn from the two above
    error: str = ""


def diagnose(title: str, equation: str, *operands) -> Diagnosis:
    d = Diagnosis(title)
    try:
        text = scorch.explain(equation, *operands, source=True)
    except Exception as e:  # noqa: BLE001
        d.error = f"scorch.explain failed: {type(e).__name__}: {e}"
        return d
    sources = sources_of(text)
    d.plan = [ln for ln in text.splitlines() if re.match(r"(contraction|dense step|reformat|kernel \w+):", ln)]
    if not sources:
        d.error = "scorch.explain printed no source (no compiled plan)"
        return d
    # the kernel with the deepest loop nest does the work (others copy values or count)
    source = max(sources, key=lambda src: max((_indent(ln) for ln in src.splitlines()
                                               if ln.lstrip().startswith("for (")), default=-1))
    if len(sources) > 1:
        d.plan.append(f"({len(sources)} generated kernels; the one with the deepest loop nest is shown)")
    lines = source.splitlines()
    first, last, inner = _hot_loop(lines)
    if first is None:
        d.error = "no loop found in the generated source"
        return d
    d.hot_loop = "\n".join(lines[first:last + 1])
    remarks, gathers = _vectorizer_remarks(source)
    if remarks is None:
        d.error = "the generated source did not compile for the vectorizer report"
        remarks = []
    wanted = range(first + 1, last + 2)  # 1-based line numbers of the hot loop
    hot = sorted(dict.fromkeys((line, text) for line, text in remarks if line in wanted), key=lambda r: r[0])
    d.vectorizer = [f"line {line}: {text}" for line, text in hot]
    inner_end = next((i for i in range(inner + 1, len(lines)) if _indent(lines[i]) <= _indent(lines[inner])), inner)
    d.findings = _findings(lines[first:last + 1], lines[inner], range(inner + 1, inner_end + 2), hot)
    if gathers:
        fact = f"The compiled kernel has {gathers} gather instructions (vgather*)."
        if re.search(r"^\s*float \w+\[\d+\];", d.hot_loop, flags=re.M):
            fact += (" With the row accumulated in a local array, GCC 12's loop unroll-and-jam (on at -O3) fuses "
                     "two nonzeros' iterations and the vectorizer loads the second one's X row with gathers, the "
                     "accumulators living on the stack; `-fno-loop-unroll-and-jam` (or `#pragma GCC optimize"
                     "(\"no-loop-unroll-and-jam\")`) gives contiguous loads again (ablation rows `spmm_gen_acc`).")
        d.findings.append(fact)
    for step in re.findall(r"^dense step:\s+torch\.einsum\('([a-z,]+)->([a-z]*)'\)", text, flags=re.M):
        if len(step[1]) >= 2:
            d.findings.insert(0, f"The plan runs a dense step first, `{step[0]}->{step[1]}`: a dense tensor over "
                                 f"every ({', '.join(step[1])}) pair is computed and then read at the sparse "
                                 "operand's nonzeros only.")
    return d


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _hot_loop(lines):
    """(first, last, innermost) line indices: the deepest ``for``, shown with the two loops around it (the row
    loop holds the workspace set-up and the store), to the outermost one's closing brace."""
    fors = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("for (")]
    if not fors:
        return None, None, None
    inner = max(fors, key=lambda i: _indent(lines[i]))
    outer = inner
    for _ in range(2):
        outer = next((i for i in reversed(fors) if i < outer and _indent(lines[i]) < _indent(lines[outer])), outer)
    depth = _indent(lines[outer])
    last = next((i for i in range(outer + 1, len(lines))
                 if _indent(lines[i]) == depth and lines[i].strip().startswith("}")), len(lines) - 1)
    return outer, last, inner


def _vectorizer_remarks(source: str):
    """``([(line, remark)], gathers)`` from ``g++ -fopt-info-vec-all`` on ``source`` and the number of gather
    instructions in the object (None where objdump is missing), or ``(None, None)`` if it does not compile."""
    flags = [f for f in runtime.flags() if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix="scorch-bench-vec-") as tmp:
        path, obj = os.path.join(tmp, "kernel.cpp"), os.path.join(tmp, "kernel.o")
        with open(path, "w") as f:
            f.write(source)
        run = subprocess.run([runtime.compiler(), *flags, "-c", "-o", obj, "-fopt-info-vec-all", path],
                             capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            return None, None
        gathers = None
        if shutil.which("objdump"):
            asm = subprocess.run(["objdump", "-d", obj], capture_output=True, text=True, timeout=60).stdout
            gathers = len(re.findall(r"\bvp?gather\w*", asm))
    out = []
    for m in re.finditer(r"kernel\.cpp:(\d+):\d+: (optimized|missed): (.*)", run.stderr):
        text = m.group(3).strip()
        if m.group(2) == "missed" and not text.startswith(("couldn't vectorize", "not vectorized")):
            continue  # the per-statement detail lines; the verdicts are enough here
        out.append((int(m.group(1)), f"{m.group(2)}: {text}"))
    return out, gathers


def _findings(loop_lines, innermost, inner_lines, line_remarks) -> list:
    """Plain-language facts about the hot loop; ``inner_lines``: the innermost loop's 1-based line numbers (GCC
    places its remarks on the ``for`` or on the body)."""
    facts = []
    remarks = [r for _, r in line_remarks]
    inner_vectorized = any(ln in inner_lines and r.startswith("optimized: loop vectorized") for ln, r in line_remarks)
    body = "\n".join(loop_lines)
    inner_depth = _indent(innermost)
    inner_body = [ln for ln in loop_lines if _indent(ln) > inner_depth]
    if any(re.search(r"\bout\[[^;]*\] \+=", ln) for ln in inner_body):
        facts.append("The innermost statement is `out[...] +=`: the output row is loaded and stored again for "
                     "every nonzero instead of being kept in registers across the row.")
    if any(re.search(r"\bacc \+=", ln) for ln in inner_body) and not inner_vectorized:
        facts.append("The innermost loop is a sum into the scalar `acc`. Without -ffast-math GCC must keep the "
                     "additions in order, so it cannot vectorize a float reduction unless the code allows "
                     "reassociation (`#pragma omp simd reduction(+:acc)`, or explicit partial sums per lane).")
    widths = sorted({int(w) for r in remarks for w in re.findall(r"using (\d+) byte vectors", r)})
    if widths:
        facts.append(f"GCC vectorized the hot loop with {', '.join(str(w * 8) for w in widths)}-bit vectors"
                     + (" (it prefers 256-bit vectors on this CPU unless told otherwise; the hand kernel uses "
                        "512-bit ones)" if max(widths) < 64 else "") + ".")
    if not inner_vectorized and remarks:
        facts.append("GCC did not vectorize the innermost loop.")
    if any("aliasing" in r for r in remarks):
        facts.append("The vectorized loop is versioned for possible aliasing: a run-time overlap check runs before "
                     "each execution of the inner loop (the `__restrict__` on the parameters does not survive into "
                     "the OpenMP region's outlined function).")
    if re.search(r"\[\(\(x\d+ \* t\d+_s\d+\) \+ d\d+\)\]", body):
        facts.append("A dense operand is read down a column (index `x * stride + d` with the loop variable `x` "
                     "multiplied by the row stride): the innermost loop walks memory with a large stride.")
    return facts
