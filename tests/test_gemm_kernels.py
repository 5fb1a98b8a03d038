"""The GEMM microbenchmark compiles each variant of inductor options and times them side by side."""

import json

import pytest

from eagle.evaluation import gemm_kernels


def test_each_variant_compiles_to_the_eager_product_and_is_timed(capsys):
    variants = ["{}", json.dumps({"max_autotune_gemm_backends": "ATEN"})]
    result = gemm_kernels.main(["--n", "64", "--k", "32", "--layers", "2", "--rows", "4", "--repeats", "3",
                                "--threads", "1", "--variants", *variants])  # fmt: skip
    assert [r["options"] for r in result] == [{}, {"max_autotune_gemm_backends": "ATEN"}]
    for r in result:
        assert r["error"] < 1e-4 and r["ms"] > 0 and r["gflop_s"] > 0
        assert r["gb_s"] == pytest.approx(r["gflop_s"] * 4 / (2 * 4))  # 4 bytes a weight, 2 * 4 rows flops
    out = capsys.readouterr().out
    assert "4 rows through 2 x [64 x 32] float32 weights" in out and "max_autotune_gemm_backends" in out


def test_the_panel_kernel_is_timed_beside_the_compiled_variants(capsys):
    from eagle.kernels import panel_kernel

    if not panel_kernel.available():
        pytest.skip(f"panel kernel: {panel_kernel._state.get('why')}")
    result = gemm_kernels.main(["--n", "64", "--k", "32", "--layers", "2", "--rows", "3", "--repeats", "3",
                                "--threads", "1", "--variants", "{}", "panel"])  # fmt: skip
    assert [r["options"] for r in result] == [{}, "panel"]
    assert all(r["error"] < 1e-4 and r["ms"] > 0 for r in result)
    assert "| panel kernel |" in capsys.readouterr().out
