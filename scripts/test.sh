#!/usr/bin/env bash
# Run the test suite (what CI runs). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k formats`.
# Without arguments the suite runs twice: as it stands, then with every dense einsum result deferred
# (SCORCH_DEFER=all, scorch/deferred.py), which shows that deferral is invisible to every dense-reference test.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
# one test process per core (pytest-xdist; SCORCH_TEST_WORKERS overrides): on 2 cores the first pass took 655 s
# from an empty kernel cache where one process took 880-1240 s; the kernel cache on disk is shared between them
WORKERS="${SCORCH_TEST_WORKERS:-auto}"
python -m pytest -q -n "$WORKERS"
echo "scorch: the suite again with every dense einsum result deferred (SCORCH_DEFER=all)" >&2
# (less the tests that only build kernels in child processes with their own cache and environment, ~3 minutes:
# sources compiled to PTX, the sanitizer builds of the einsum matrix and of damaged cache entries, plans kept on
# disk, the golden sources: deferral does not change what they build; the CUDA kernels emulated on the CPU
# (tests/compiler/test_cuda.py, 536 cases: deferral acts before any backend, and the C++ one's cases cover it);
# and the 2-process launch of
# tests/distributed, ~20 s a pass, checked under deferral by hand: `SCORCH_DEFER=all bash scripts/test.sh tests/distributed`)
SCORCH_DEFER=all python -m pytest -q -n "$WORKERS" -p no:cacheprovider \
    --deselect "tests/distributed/test_distributed.py::test_ddp_sparse_linear_adam_matches_one_process" \
    --deselect "tests/distributed/test_distributed.py::test_gnn_split_graph_trains_as_one_process" \
    --deselect "tests/distributed/test_distributed.py::test_moe_expert_parallel_matches_one_process" \
    --deselect "tests/compiler/test_cuda.py" \
    --deselect "tests/compiler/test_sanitize.py::test_matrix_subset_under_sanitizers" \
    --deselect "tests/compiler/test_sanitize.py::test_damaged_cache_entries_under_sanitizers" \
    --deselect "tests/compiler/test_plan_store.py" --deselect "tests/compiler/test_golden.py"

# Every kernel variant the CPU flags select, on whatever CPU runs this: the vector width (SCORCH_VECTOR_BYTES: GCC's
# vector types of any width compile and run on any x86-64 CPU) and whether row sums' lead vectors gather
# (SCORCH_LEAD_GATHERS: on by default on Intel, off on AMD). The passes above ran this machine's own variant; the
# others run the tests whose kernels or kept calls differ by variant: products and their direct (C) call, SpMV's
# row sums, register tiles, half precision, the weight family's tiles, the direct convolution's planes (their rows
# are aligned to the vectors' lanes: a tap's shift past a row's end was wrong with 16- and 32-byte vectors) (about
# 60 s a variant from an empty kernel cache on 2 cores). (The golden sources pin their own variant, whatever the
# host's; the C operators' test is the same under every variant.) The variants also flip whether n:4 weights run
# with their rows in a vector's lanes (SCORCH_LANE_PICKS: on by default on AMD CPUs with AVX2), so that the weight
# family's tests run both n:4 kernels on any CPU.
read -r NATIVE_V NATIVE_G NATIVE_P < <(python -c "from scorch.compiler.target import CPU
print(CPU.vector_bytes, int(CPU.lead_gathers), int(CPU.lane_picks))")
for V in 16 32 64; do
    for G in 0 1; do
        [ "$V $G" = "$NATIVE_V $NATIVE_G" ] && continue
        echo "scorch: the kernel variants' tests with SCORCH_VECTOR_BYTES=$V SCORCH_LEAD_GATHERS=$G" \
            "SCORCH_LANE_PICKS=$((1 - NATIVE_P))" >&2
        SCORCH_VECTOR_BYTES=$V SCORCH_LEAD_GATHERS=$G SCORCH_LANE_PICKS=$((1 - NATIVE_P)) \
            python -m pytest -q -n "$WORKERS" -p no:cacheprovider \
            tests/test_direct_call.py tests/compiler/test_vector_sum.py tests/compiler/test_vectorize.py \
            tests/ops/test_half.py tests/ops/test_weight_kernels.py::test_the_family_serves_linear_and_writes_row_major \
            tests/ops/test_weight_kernels.py::test_gradients_equal_the_masked_dense_layer \
            tests/ops/test_weight_kernels.py::test_one_token_runs_row_dots tests/ops/test_weight_kernels.py::test_16_bit_values \
            tests/ops/test_weight_kernels.py::test_one_token_through_the_bitmap \
            tests/ops/test_weight_kernels.py::test_a_2_4_bfloat16_weight_through_its_pairs \
            tests/ops/test_weight_pair_tiles.py::test_pair_tiles_equal_the_dense_linear tests/ops/test_weight_picks.py \
            tests/ops/test_weight_kernels.py::test_linear_equals_dense_linear \
            tests/ops/test_weight_backward.py::test_gradients_equal_the_masked_dense_layer \
            tests/ops/test_weight_backward.py::test_16_bit_block_gradients \
            tests/ops/test_weight_picks_grad.py tests/ops/test_weight_picks_decode.py tests/ops/test_weight_depth.py \
            tests/nn/test_conv_direct.py::test_direct_conv_matches_dense tests/nn/test_conv_picks.py \
            tests/nn/test_conv_direct.py::test_dilated_taps_farther_apart_than_the_grid_is_wide
    done
done
