"""bfloat16 BSR weights on matrix tiles (``compiler.weights_amx``, ``engine.amx``, ``codegen.amx``).

No CPU these tests run on need have AMX: the kernels run through the scalar model of the instructions
(``SCORCH_AMX=model``), which parses the tile configuration and checks every tile's shape as the CPU does. The
loop IR's meaning (the NumPy interpreter) and the model's C++ are both checked against dense torch; the CPU's own
form is checked to assemble into the instructions it names; the choice of the mode (the CPU's flags, Linux's
permission, the first-use check in a child process and its verdict kept on disk) is checked with its parts
replaced."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch.compiler import interp, runtime, weights as family, weights_amx
from scorch.compiler.codegen import cpp
from scorch.compiler.target import CPU
from scorch.engine import amx, weights as kernels

F = torch.nn.functional
BLOCKS = ((16, 16), (16, 32), (8, 2), (4, 4), (2, 8), (16, 2), (1, 2))


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(amx, "FORCE", "model")


def _weight(block, out_blocks, in_blocks, density, seed):
    g = torch.Generator().manual_seed(seed)
    bh, bw = block
    keep = torch.rand(out_blocks, in_blocks, generator=g) < density
    w = torch.randn(out_blocks * bh, in_blocks * bw, generator=g)
    return (w * keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)).bfloat16()


@settings(max_examples=30, deadline=None)
@given(block=st.sampled_from(BLOCKS), out_blocks=st.integers(1, 5), in_blocks=st.integers(1, 5),
       tokens=st.integers(8, 100), density=st.sampled_from([0.0, 0.3, 1.0]), bias=st.booleans(),
       activation=st.sampled_from([None, "relu", "gelu"]), seed=st.integers(0, 2 ** 16))
def test_tiles_equal_the_dense_linear(block, out_blocks, in_blocks, tokens, density, bias, activation, seed):
    amx.FORCE = "model"
    try:
        w = _weight(block, out_blocks, in_blocks, density, seed)
        s = scorch.asformat(w, f"bsr{block}")
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
        b = torch.randn(w.shape[0], generator=g).bfloat16() if bias else None
        assert kernels.plan_for(s, tokens, bias).amx == "model"
        got = kernels.linear(s, x, b, activation)
    finally:
        amx.FORCE = None
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    want = {None: want, "relu": torch.relu(want), "gelu": F.gelu(want)}[activation]
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # (the same sums as the vector kernels, whose result rounds the same float32 values into bfloat16)
    torch.testing.assert_close(got.float(), kernels.linear(s, x, b, activation).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tokens", [1, 16, 31, 32, 33, 64])
def test_the_loop_ir_means_the_dense_product(tokens):
    """The kernel's loop IR run by the NumPy interpreter (``TileRow.loops``): whole and partial tiles, row chunks."""
    w = _weight((16, 16), 3, 2, 0.5, 4)
    s = scorch.asformat(w, "bsr(16, 16)")
    x = torch.randn(tokens, 32).bfloat16()
    b = torch.randn(48).bfloat16()
    plan = family.tiles(replace(CPU, vector_bytes=64, amx="model"), "bsr", tokens, "bf16", "bf16", "i64", "i64",
                        (16, 16), bias=True)
    assert plan.amx == "model" and plan.T == 32
    arrays = kernels._arrays(s)
    vals = s._vals.detach().float().reshape(-1, 16, 8, 2).permute(0, 2, 1, 3).reshape(-1)
    y = np.zeros(tokens * 48, np.float32)
    interp.run(weights_amx.forward(plan), {
        "pos": arrays["pos"].long().numpy(), "crd": arrays["crd"].long().numpy(), "vals": vals.numpy(),
        "bias": b.float().numpy(), "x": x.float().reshape(-1).numpy(), "y": y, "n": tokens, "n_in": 32,
        "n_out": 48, "groups": 32, "chunks": 2, "row_chunk": 32, "nthreads": 1})
    want = x.float() @ w.float().T + b.float()
    np.testing.assert_allclose(y.reshape(tokens, 48), want.numpy(), rtol=1e-5, atol=1e-5)


def test_plans_on_tiles_only_for_bfloat16_blocks_that_fit_a_tile():
    target = replace(CPU, vector_bytes=64, amx="model")

    def plan(vtype="bf16", block=(16, 16), transposed=False, kind="bsr"):
        return family.tiles(target, kind, 64, vtype, vtype, "i32", "i32", block, transposed=transposed)
    assert plan().amx == "model" and plan(block=(16, 32)).amx and plan(block=(1, 2)).amx
    assert not plan("f32").amx and not plan(block=(32, 32)).amx and not plan(block=(16, 64)).amx
    assert not plan(block=(4, 3)).amx and not plan(transposed=True).amx and not plan(kind="csr").amx
    assert not family.tiles(replace(target, amx=""), "bsr", 64, "bf16", "bf16", "i32", "i32", (16, 16)).amx


def test_training_through_the_tiles(model):
    """Forward on tiles, the gradients by the vector kernels: equal to the dense layer's."""
    w = _weight((16, 16), 2, 3, 0.6, 8)
    p = scorch.asformat(w, "bsr(16, 16)").requires_grad_()
    x = torch.randn(40, 48).bfloat16().requires_grad_()
    y = F.linear(x, p)
    y.backward(torch.ones_like(y))
    wd = w.float().requires_grad_()
    xd = x.detach().float().requires_grad_()
    yd = F.linear(xd, wd)
    yd.backward(torch.ones_like(yd))
    torch.testing.assert_close(y.float(), yd, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.float(), xd.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(p.grad.to_dense().float() * (w != 0), wd.grad * (w != 0), rtol=2e-2, atol=5e-2)


def test_changed_values_are_laid_out_again(model):
    """The values as B tiles are kept per version of the values: an update in place is seen."""
    w = _weight((16, 16), 2, 2, 1.0, 9)
    s = scorch.asformat(w, "bsr(16, 16)")
    x = torch.randn(32, 32).bfloat16()
    first = F.linear(x, s)
    with torch.no_grad():
        s._vals.mul_(2)
    torch.testing.assert_close(F.linear(x, s).float(), 2 * first.float(), rtol=1e-2, atol=1e-2)


def test_the_cpus_form_assembles_into_tile_instructions(tmp_path):
    """The kernel for a CPU with AMX compiles anywhere (inline assembly, no intrinsics' target) into ldtilecfg,
    tileloadd, tdpbf16ps (C += A x B: AT&T order B, A, C), tilestored and tilerelease."""
    plan = family.tiles(replace(CPU, vector_bytes=64, amx="tiles"), "bsr", 64, "bf16", "bf16", "i32", "i16",
                        (16, 16), bias=True)
    source = cpp.generate(weights_amx.forward(plan))
    assert "scorch_amx_tiles" in source and "scorch_amx_model" not in source
    if not (sys.platform.startswith("linux") and os.uname().machine == "x86_64" and shutil.which("objdump")):
        pytest.skip("needs an x86-64 Linux assembler and objdump")
    (tmp_path / "k.cpp").write_text(source)
    flags = [f for f in runtime.flags() if not f.startswith("-fsanitize")]
    subprocess.run([runtime.compiler(), *flags, "-c", str(tmp_path / "k.cpp"), "-o", str(tmp_path / "k.o")],
                   check=True, capture_output=True)
    text = subprocess.run(["objdump", "-d", str(tmp_path / "k.o")], check=True, capture_output=True,
                          text=True).stdout
    for instruction in ("ldtilecfg", "tilezero", "tileloadd", "tilestored", "tilerelease"):
        assert instruction in text
    assert "tdpbf16ps %tmm2,%tmm3,%tmm0" in text and "tdpbf16ps %tmm2,%tmm4,%tmm1" in text


def test_the_model_faults_on_tiles_that_do_not_fit(tmp_path):
    """The model checks what the CPU checks: a product whose tiles' shapes do not fit each other aborts (here a
    configuration whose B tile has a row fewer than A has pairs), in a child process."""
    plan = family.tiles(replace(CPU, amx="model"), "bsr", 32, "bf16", "bf16", "i64", "i64", (16, 32))
    kernel = weights_amx.forward(plan)
    source = cpp.generate(kernel)
    assert "t == tiles ? depth : 16" in source
    source = source.replace("t == tiles ? depth : 16", "t == tiles ? depth - 1 : 16")
    script = f"""
import ctypes, torch
from scorch.compiler import runtime
from scorch.compiler.codegen import cpp
import scorch.compiler.weights_amx as m, scorch.compiler.weights as f
from dataclasses import replace
from scorch.compiler.target import CPU
kernel = m.forward(f.tiles(replace(CPU, amx="model"), "bsr", 32, "bf16", "bf16", "i64", "i64", (16, 32)))
k = runtime.load(open({str(tmp_path / 'bad.cpp')!r}).read(), kernel.name, cpp.argtypes(kernel))
pos, crd = torch.tensor([0, 1]), torch.tensor([0])
vals, x, y = torch.ones(512, dtype=torch.bfloat16), torch.ones(32, 32, dtype=torch.bfloat16), torch.empty(32, 16,
    dtype=torch.bfloat16)
cpp.call(kernel, k, dict(pos=pos, crd=crd, vals=vals, x=x, y=y, n=32, n_in=32, n_out=16, groups=32, chunks=1,
         row_chunk=16, nthreads=1))
print("no fault")
"""
    (tmp_path / "bad.cpp").write_text(source)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "no fault" not in done.stdout
    assert "AMX model: tdpbf16ps: the tiles' shapes do not fit" in done.stderr


def test_the_mode_follows_the_override(monkeypatch):
    monkeypatch.setenv("SCORCH_AMX", "model")
    assert amx.mode() == "model"
    monkeypatch.setenv("SCORCH_AMX", "0")
    assert amx.mode() == ""
    monkeypatch.setenv("SCORCH_AMX", "yes")
    with pytest.raises(ValueError, match="SCORCH_AMX must be"):
        amx.mode()
    monkeypatch.setenv("SCORCH_AMX", "1")
    monkeypatch.setattr(amx, "_missing", lambda: "this CPU has no AMX tiles")
    with pytest.raises(RuntimeError, match="SCORCH_AMX=1, but this CPU has no AMX tiles"):
        amx.mode()
    monkeypatch.delenv("SCORCH_AMX")
    assert amx.mode() == ""  # (nothing runs the check where the CPU lacks the tiles)


def test_the_first_use_verdict_is_kept_and_authenticated(monkeypatch, tmp_path):
    """Where the CPU has the tiles, the first use runs the check in a child process once; its verdict is kept in
    the kernel cache (an HMAC under the cache's secret) and a failed check warns and keeps the vector kernels.
    A verdict file altered by hand is not believed: the check runs again."""
    monkeypatch.setenv("SCORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SCORCH_AMX", raising=False)
    monkeypatch.setattr(amx, "_missing", lambda: "")
    runs = []
    monkeypatch.setattr(amx, "check", lambda: runs.append(1) or (False, "a difference of 1.5"))
    amx._trusted.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="failed their first-use check on this CPU .a difference of 1.5"):
            assert amx.mode() == ""
        amx._trusted.cache_clear()
        assert amx.mode() == "" and len(runs) == 1  # (the verdict from disk)
        (verdict,) = runtime._usable(runtime.cache_dir()).glob("amx-*.verdict")
        verdict.write_bytes(b"1" + verdict.read_bytes()[1:])  # (a verdict turned to "passed" by hand)
        amx._trusted.cache_clear()
        monkeypatch.setattr(amx, "check", lambda: runs.append(1) or (True, ""))
        assert amx.mode() == "tiles" and len(runs) == 2
    finally:
        amx._trusted.cache_clear()


def test_the_first_use_check_runs_products_in_a_child():
    """The check itself, through the model (any CPU): passes; a child that cannot use tiles fails it, saying why."""
    assert amx.check("model") == (True, "")
    passed, why = amx.check("0")
    assert not passed and "exit status 1" in why and "SCORCH_AMX=1 or model" in why


HARDWARE = """
import torch, scorch
from scorch.engine import amx, weights as kernels
assert amx.mode() == "tiles"
F = torch.nn.functional
g = torch.Generator().manual_seed(5)
for block in ((16, 16), (16, 32), (8, 2), (4, 4), (1, 2)):
    for out_blocks, in_blocks, tokens in ((3, 4, 8), (2, 5, 33), (5, 3, 100), (1, 1, 32)):
        bh, bw = block
        keep = torch.rand(out_blocks, in_blocks, generator=g) < 0.5
        w = (torch.randn(out_blocks * bh, in_blocks * bw, generator=g)
             * keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)).bfloat16()
        s = scorch.asformat(w, f"bsr{block}")
        x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
        b = torch.randn(w.shape[0], generator=g).bfloat16()
        assert kernels.plan_for(s, tokens, True).amx == "tiles"
        got = kernels.linear(s, x, b, "gelu").float()
        want = F.gelu(x.float() @ w.float().T + b.float())
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (block, out_blocks, in_blocks, tokens)
print("tiles ok")
"""


@pytest.mark.skipif(amx._missing() != "", reason="needs a CPU with AMX tiles that Linux lets this process use")
def test_the_cpus_tiles_equal_the_dense_linear():
    """On a CPU with AMX (Intel Xeon from Sapphire Rapids on), the tile kernels themselves, with no first-use check,
    against the dense product, in a child process (a fault ends only it)."""
    done = subprocess.run([sys.executable, "-c", HARDWARE], env=dict(os.environ, SCORCH_AMX="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "tiles ok" in done.stdout, done.stderr[-3000:]


def test_an_eager_layer_replays_its_tile_call(model):
    """An eager ``F.linear`` keeps its one kernel call (``weights_kept``) and makes it again on the next input: the
    tile kernel's too (its input read in place, a partial tile through the padded buffer)."""
    w = _weight((16, 16), 3, 4, 0.5, 11)
    s = scorch.asformat(w, "bsr(16, 16)")
    b = torch.randn(48).bfloat16()
    for seed in (1, 2, 3):
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
        torch.testing.assert_close(F.linear(x, s, b).float(), x.float() @ w.float().T + b.float(), rtol=2e-2,
                                   atol=2e-2)
