"""The README and the docs run as written: every ```python block of README.md and docs/*.md alone in a fresh
interpreter (as a new user pastes it: its imports included), and every command a ```bash block names exists.

A block may carry an HTML comment on the line above it:
- ``<!-- needs: transformers, torch_geometric -->``: packages (or ``cuda``, a GPU) it needs; where one is missing
  the block is skipped, with the reason, never silently;
- ``<!-- fragment: why -->``: a block that cannot run alone (say, one that needs a ``torchrun`` process group);
  it is reported as skipped with the reason.
"""
import functools
import importlib.util
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# a fenced block with the marker comments (if any) on the lines just above it
BLOCK = re.compile(r"((?:^<!--[^\n]*-->\n)*)^```(\w+)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*(needs|fragment):\s*(.*?)\s*-->")


def blocks(path, language):
    """``(marks, code, line)`` for each ``language`` block of ``path``; ``marks`` maps a marker to its text."""
    text = path.read_text()
    found = []
    for m in BLOCK.finditer(text):
        if m.group(2) == language:
            marks = {k: v for k, v in MARKER.findall(m.group(1))}
            found.append((marks, m.group(3), text.count("\n", 0, m.start(3)) + 1))
    return found


def cases(language):
    return [pytest.param(path, marks, code, line, id=f"{path.relative_to(ROOT)}:{line}")
            for path in DOCUMENTS for marks, code, line in blocks(path, language)]


def missing(needs):
    """The needed packages (or ``cuda``) that this environment lacks."""
    gone = []
    for name in (n.strip() for n in needs.split(",") if n.strip()):
        if name == "cuda":
            import torch
            if not torch.cuda.is_available():
                gone.append("cuda (a GPU)")
        elif importlib.util.find_spec(name) is None:
            gone.append(name)
    return gone


# Every runnable block runs in one child interpreter, each as __main__ in a namespace of its own (so a name it
# uses without importing it raises NameError) and under its own time limit; one interpreter, not one per block,
# because importing scorch and torch takes seconds and the blocks are many. A dense fallback in an example is an
# error: the docs should show ops that run sparse. The child's working folder is a temporary one (the training
# example saves a file).
RUNNER = """import contextlib, io, json, signal, sys, traceback, warnings
import scorch
warnings.simplefilter("error", scorch.DensifyWarning)
def late(*_):
    raise TimeoutError("the block ran past its time limit")
signal.signal(signal.SIGALRM, late)
results = []
for job in json.load(open(sys.argv[1])):
    out = io.StringIO()
    error = None
    signal.alarm(job["timeout"])
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(job["code"], job["name"], "exec"), {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    finally:
        signal.alarm(0)
    results.append({"stdout": out.getvalue(), "error": error})
json.dump(results, open(sys.argv[2], "w"))
"""
BLOCK_TIMEOUT = 120


def run_blocks(jobs, folder):
    """``[(name, code)]`` or ``[(name, code, seconds)]`` -> ``[{"stdout", "error"}]``, run as the runner above says."""
    import json
    folder = pathlib.Path(folder)
    jobs = [(*job, BLOCK_TIMEOUT)[:3] for job in jobs]
    (folder / "jobs.json").write_text(json.dumps([{"name": n, "code": c, "timeout": s} for n, c, s in jobs]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", RUNNER, "jobs.json", "results.json"], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=sum(s for _, _, s in jobs) + 60)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((folder / "results.json").read_text())


def name(path, line):
    return f"{path.relative_to(ROOT)}, the block at line {line}"


def runnable(marks):
    """Why a block is not run here, or None."""
    if "fragment" in marks:
        return f"a fragment, not run: {marks['fragment']}"
    gone = missing(marks.get("needs", ""))
    return f"needs {', '.join(gone)}" if gone else None


@functools.cache
def results():
    """Every runnable block's result, by its name: all run once, in the documents' order, when the first is asked."""
    jobs = [(name(path, line), code) for path in DOCUMENTS for marks, code, line in blocks(path, "python")
            if runnable(marks) is None]
    # without a GPU the GPU example runs with its device moves taken out: the CPU path of the same code
    gpu_marks, gpu_code, _ = blocks(ROOT / "docs" / "gpu.md", "python")[0]
    jobs.append(("docs/gpu.md on the CPU", gpu_code.replace(".cuda()", "").replace(', device="cuda"', "")))
    folder = tempfile.mkdtemp(prefix="scorch-docs-")
    try:
        return dict(zip([n for n, _ in jobs], run_blocks(jobs, folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# What some blocks visibly print, beyond running: (document, a line of the block) -> strings its output holds.
EXPECTED = {
    ("README.md", "model[0].weight.format.name"): ["torch.Size([32, 10]) csr", "loop order:"],            # the quickstart
    ("README.md", "T = S.to_torch()"): ["SparseTensor(format=csr, shape=(6, 8)", "bsr(2, 4)"],
    ("README.md", "torch.save(W"): ["csr csr"],
    ("formats.md", "print(B.format.name, B.levels[1].pos"): ["bsr(2, 4)"],
    ("training.md", "s.apply(); s.summary()"): ["bsr(16, 16)", "csr"],
}


def expected(path, code):
    return [s for (name, line), strings in EXPECTED.items() if name == path.name and line in code for s in strings]


def test_the_documents_have_blocks_to_run():
    """The parser finds the README's blocks (a regex that matched nothing would pass every case below)."""
    assert len(blocks(README, "python")) >= 6 and len(blocks(README, "bash")) >= 2
    assert blocks(ROOT / "docs" / "gpu.md", "python")[0][0] == {"needs": "cuda"}


@pytest.mark.parametrize("path, marks, code, line", cases("python"))
def test_python_block_runs_alone(path, marks, code, line):
    why = runnable(marks)
    if why:
        pytest.skip(why)
    result = results()[name(path, line)]
    assert result["error"] is None, f"{name(path, line)}:\n{code}\n{result['error'][-4000:]}"
    for s in expected(path, code):
        assert s in result["stdout"], (s, result["stdout"][-4000:])


def test_every_expectation_meets_a_block():
    """An expectation whose block was edited away would check nothing: each must meet exactly one block."""
    for name, line in EXPECTED:
        path = README if name == "README.md" else ROOT / "docs" / name
        assert sum(line in code for _, code, _ in blocks(path, "python")) == 1, (name, line)


def test_gpu_example_on_the_cpu():
    """On a GPU the example runs verbatim (above); without one it runs with the device moves taken out, so it stays
    valid, and its plan names the CPU."""
    import torch
    result = results()["docs/gpu.md on the CPU"]
    assert result["error"] is None, result["error"]
    assert ("target:       CUDA" in result["stdout"]) == torch.cuda.is_available()


def test_a_failing_block_fails(tmp_path):
    """The runner is not vacuous: a block that forgets an import, one that falls back to the dense form and one
    that runs too long each report their error, and the blocks after them still run."""
    jobs = [("a", "import torch\nx = torch.ones(2)"), ("b", "print(x)"),
            ("c", "import scorch\nscorch.asformat(scorch.eye(3), 'csr').exp()"), ("d", "while True: pass", 1),
            ("e", "print('ran')")]
    got = run_blocks(jobs, tmp_path)
    assert got[0]["error"] is None and "NameError" in got[1]["error"]
    assert "DensifyWarning" in got[2]["error"] and "TimeoutError" in got[3]["error"]
    assert got[4] == {"stdout": "ran\n", "error": None}


def module_exists(name):
    """A module of this checkout (by its file, without importing it) or an installed one."""
    path = ROOT.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return True
    return name.split(".")[0] not in {"scorch", "apps", "benchmarks", "tools", "tests"} and \
        importlib.util.find_spec(name) is not None


def pip_extras():
    """The extras pyproject.toml declares (read by hand: tomllib is Python 3.11+, and scorch supports 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", table, re.M))


def command_problems(line):
    """What a console line names that does not exist: a script, an app, a module, a pip extra, a file, a program."""
    words = shlex.split(line, comments=True)
    if not words:
        return []
    problems = []
    program, args = words[0], words[1:]
    if program in {"python", "python3"} or program == "torchrun":
        if "-m" in args:
            module = args[args.index("-m") + 1]
            if not module_exists(module):
                problems.append(f"module {module}")
    elif program == "bash":
        if args[0] == "scripts/app.sh" and not module_exists(f"apps.{args[1]}"):
            problems.append(f"app {args[1]}")
    elif program == "pip":
        extras = pip_extras()
        for spec in args:
            for extra in re.findall(r"^\.\[(.*)\]$", spec)[0].split(",") if re.match(r"^\.\[", spec) else []:
                if extra not in extras:
                    problems.append(f"pip extra [{extra}]")
    if program not in {"python", "python3", "bash"} and shutil.which(program) is None:
        problems.append(f"program {program}")
    for word in args:
        if re.match(r"^(scripts|tests|apps|benchmarks|tools|docs)/", word) and not (ROOT / word).exists():
            problems.append(f"file {word}")
    return problems


@pytest.mark.parametrize("path, marks, code, line", cases("bash"))
def test_console_block_names_what_exists(path, marks, code, line):
    lines = code.replace("\\\n", " ").splitlines()          # a command continued with a backslash is one line
    problems = [f"{line!r}: {', '.join(p)}" for line in lines if (p := command_problems(line))]
    assert not problems, problems


def test_console_check_can_fail():
    """The console check is not vacuous: a missing script, app, module, extra and program are each named."""
    assert command_problems("bash scripts/nothing.sh") == ["file scripts/nothing.sh"]
    assert command_problems("bash scripts/app.sh nothing") == ["app nothing"]
    assert command_problems("python -m benchmarks.nothing") == ["module benchmarks.nothing"]
    assert command_problems('pip install -e ".[nothing]"') == ["pip extra [nothing]"]
    assert command_problems("no-such-program-here --flag") == ["program no-such-program-here"]
    assert command_problems("bash scripts/test.sh -m slow  # a comment") == []


def test_needs_marker_skips_only_what_is_missing():
    assert missing("no_such_package_here, pytest") == ["no_such_package_here"]
    assert missing("") == []


def test_sparse_api_doc_is_in_sync_with_the_registry():
    from scorch import catalog
    doc = ROOT / "docs" / "sparse-api.md"
    made_on = re.search(r"registry on torch (\d+\.\d+)", doc.read_text())
    assert made_on, "docs/sparse-api.md names the torch release it was generated on"
    if made_on.group(1) != catalog.torch_minor():  # (another release has other torch names: 2.14 lists 2 more)
        pytest.skip(f"docs/sparse-api.md lists torch {made_on.group(1)}'s names; this is torch {catalog.torch_minor()}")
    assert doc.read_text() == catalog.markdown(), "regenerate: python -m scorch.catalog > docs/sparse-api.md"


def test_links_resolve():
    """Every relative link of the README and the docs names a file of the checkout (the docs moved; a link left
    behind would send a new user nowhere), and the docs index links every page in docs/."""
    broken = []
    for path in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", path.read_text()):
            if not re.match(r"^[a-z]+:", target) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    index = (ROOT / "docs" / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, unlisted
