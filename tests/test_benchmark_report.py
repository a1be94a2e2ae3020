"""The benchmark report: app tables (training and inference ratios, quality), series and their plots."""
import os

from benchmarks import report
from benchmarks.apps import app_table, timing_of
from benchmarks.timing import Row, Table, Timing


def test_app_table_ratios_and_failures():
    runs = {"scorch": lambda: {"epoch_times": [0.010, 0.012, 0.011], "infer_s": 0.002, "acc": 0.8},
            "torch.sparse": lambda: {"epoch_s": 0.022, "infer_s": 0.004, "acc": 0.8},
            "PyG": lambda: (_ for _ in ()).throw(RuntimeError("no such layer"))}
    t = app_table("gnn", "GCN, test", "setup", runs, "scorch", "torch.sparse", lambda r: f"acc {r['acc']}")
    assert t.row("scorch").timing == Timing(0.011, 0.010, 3)
    assert abs(t.ratio("torch.sparse") - 2.0) < 1e-9 and abs(t.infer_ratio("torch.sparse") - 2.0) < 1e-9
    assert t.row("PyG").timing is None and "no such layer" in t.row("PyG").status
    assert timing_of({}, "epoch") is None


def test_report_writes_tables_and_plots(tmp_path):
    app = Table("gnn", "GCN, test", "setup", kind="app", scorch="scorch", torch="torch.sparse")
    app.rows = [Row("scorch", Timing(0.01, 0.01, 3), infer=Timing(0.002, 0.002, 3), metric="acc 0.81"),
                Row("torch.sparse", Timing(0.02, 0.02, 3), infer=Timing(0.003, 0.003, 3), metric="acc 0.81")]
    series = Table("scaling", "SpMM time against nnz", "setup", kind="series", x_label="nonzeros",
                   series={"scorch": [(100, 1e-4), (1000, 5e-4)], "torch": [(100, 2e-4), (1000, 9e-4)]})
    machine = {"cpu": "test", "cores": 2, "threads": 2, "load_before": "0", "load_after": "0"}
    md, plots = report.write(str(tmp_path), [app, series], machine, {}, [], "python -m benchmarks", 1.0, True)
    text = open(md).read()
    assert "| scorch | 10.0 | 2 | acc 0.81 | (scorch) | (scorch) |" in text
    assert "| torch.sparse | 20.0 | 3 | acc 0.81 | 2.00x | 1.50x |" in text
    assert "| 1,000 |" in text
    for name in ("apps.png", "spmm_time_against_nnz.png"):
        assert os.path.getsize(tmp_path / "plots" / name) > 1000
    assert "## Summary" in report.summary_section(md)


def test_report_keeps_the_gpu_sections_of_the_file_it_replaces(tmp_path):
    """``benchmarks.gpu --write`` appends ``## GPU: ...`` tables on a machine with a GPU; a CPU run rewriting
    RESULTS.md keeps them (and only them) from the old file."""
    md = tmp_path / "RESULTS.md"
    md.write_text("# old\n\n## Summary\n\nold summary\n\n## GPU: NVIDIA H100\n\n| a |\n\n## GPU: NVIDIA H200\n\n"
                  "| b |\n\n## Plots\n\nold plot\n")
    series = Table("scaling", "SpMM time against nnz", "setup", kind="series", x_label="nonzeros",
                   series={"scorch": [(100, 1e-4), (1000, 5e-4)]})
    machine = {"cpu": "test", "cores": 2, "threads": 2, "load_before": "0", "load_after": "0"}
    report.write(str(tmp_path), [series], machine, {}, [], "python -m benchmarks", 1.0, True)
    text = md.read_text()
    assert "old summary" not in text and "old plot" not in text
    assert text.index("## GPU: NVIDIA H100") < text.index("| a |") < text.index("## GPU: NVIDIA H200") < text.index("| b |")
    assert text.index("## Plots") < text.index("## GPU: NVIDIA H100")
    report.write(str(tmp_path), [series], machine, {}, [], "python -m benchmarks", 1.0, True)
    assert md.read_text().count("## GPU: NVIDIA H200") == 1


def test_report_names_the_cpu(tmp_path):
    """Every run's RESULTS.md names the CPU: vendor and family, the ISA extensions kernels are chosen by, the caches,
    the kernel variant scorch's code takes and whether bfloat16 BSR ran on AMX tiles (a speedup counts only against
    a peer on the same CPU)."""
    details = report.cpu_details()
    assert set(details) == {"CPU vendor / family / model", "CPU ISA", "CPU caches (per core, L3 shared)",
                            "scorch kernel variant", "bfloat16 BSR on AMX tiles"}
    assert details["bfloat16 BSR on AMX tiles"].startswith("no: ")  # (the suite pins SCORCH_AMX=0: conftest)
    from scorch.compiler.target import CPU
    assert f"{CPU.vector_bytes}-byte vectors" in details["scorch kernel variant"]
    machine = {"cpu": "test", "cores": 2, "threads": 2, "load_before": "0", **details, "load_after": "0"}
    md, _ = report.write(str(tmp_path), [], machine, {}, [], "python -m benchmarks", 1.0, True)
    text = open(md).read()
    for key, value in details.items():
        assert f"- {key}: {value}" in text
