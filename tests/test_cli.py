"""The fa3gen command line, called in-process through main(argv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fa3gen import REGISTRY, registry, render
from fa3gen.cli import main

pytestmark = pytest.mark.usefixtures("cache_dir")


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name, spec in REGISTRY.items():
        assert name in out and spec.name in out
    assert "128x80" in out  # tiles shown
    for name, spec in registry.PREPARE_REGISTRY.items():
        assert any(line.split() == [name, spec.input_dtype, str(spec.hadamard_block)] for line in out.splitlines())


def test_render_one_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "fwd_d96_fp16"]) == 0
    assert capsys.readouterr().out == render(REGISTRY["fwd_d96_fp16"])


def test_render_json_and_all(tmp_path: Path) -> None:
    spec_json = '{"head_dim": 128, "causal": true, "stages": 1}'
    assert main(["render", spec_json, "--out", str(tmp_path / "one")]) == 0
    (written,) = (tmp_path / "one").iterdir()
    assert written.name.startswith("fwd_d128_bf16_causal_m") and written.suffix == ".cu"
    assert main(["render", "--all", "--out", str(tmp_path / "all")]) == 0
    assert sorted(p.stem for p in (tmp_path / "all").iterdir()) == sorted(registry.all_specs())


def test_render_fp8_prepare_spec_by_name_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    """The fused fp8 prepare kernels are specs too: by registry name, or as JSON with their kind."""
    assert main(["render", "fp8prep_d128_bf16"]) == 0
    assert capsys.readouterr().out == render(registry.PREPARE_REGISTRY["fp8prep_d128_bf16"])
    assert main(["render", '{"kind": "fp8_prepare", "head_dim": 192, "input_dtype": "fp32"}']) == 0
    assert "using Input = float;" in capsys.readouterr().out
    assert main(["render", '{"kind": "fp8_prepare", "head_dim": 80}']) == 2
    assert "head_dim must be a multiple of 32" in capsys.readouterr().err


def test_bad_spec_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "fwd_d80_bf16"]) == 2
    err = capsys.readouterr().err
    assert "unknown spec 'fwd_d80_bf16'" in err and "fwd_d128_bf16" in err
    assert main(["build", '{"head_dim": 128, "block_n": 120}']) == 2
    assert "block_n=120 must be a multiple of 16" in capsys.readouterr().err


def test_doctor(capsys: pytest.CaptureFixture[str], cache_dir: Path) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "nvcc" in out and "release" in out
    assert "cutlass" in out and "4." in out
    assert str(cache_dir) in out and "torch" in out
    assert "compute capability" in out or "no CUDA GPU" in out


def test_doctor_reports_missing_nvcc(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FA3GEN_NVCC", "/nonexistent")
    assert main(["doctor"]) == 1
    assert "MISSING" in capsys.readouterr().out


@pytest.mark.usefixtures("mini_templates")
def test_build_cache_ls_clear(capsys: pytest.CaptureFixture[str], cache_dir: Path) -> None:
    assert main(["build", "fwd_d128_bf16", "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert f"[1/1] {REGISTRY['fwd_d128_bf16'].name}: built in" in out
    (entry,) = [p for p in cache_dir.iterdir() if p.name.startswith("fwd_")]
    assert str(entry) in out

    assert main(["build", "fwd_d128_bf16"]) == 0
    assert "cached" in capsys.readouterr().out

    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert entry.name in out and " ok " in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not entry.exists()


@pytest.mark.usefixtures("mini_templates")
def test_build_failure_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from fa3gen_testing import write_templates

    monkeypatch.setenv("FA3GEN_TEMPLATES_DIR", str(write_templates(tmp_path / "bad", "#error boom {{ spec.name }}\n")))
    assert main(["build", "fwd_d64_bf16"]) == 1
    err = capsys.readouterr().err
    assert "boom" in err and "generated source:" in err


@pytest.mark.usefixtures("warm_cache")
def test_demo_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the no-GPU path")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "fwd_d128_bf16" in out and "kernel.so" in out and "ptxas:" in out and "registers" in out
    assert "No Hopper GPU found: kernel compiled, running it needs an sm_90 GPU" in out


def test_bench_is_forwarded(monkeypatch: pytest.MonkeyPatch) -> None:
    import fa3gen.bench

    seen: list[list[str]] = []
    monkeypatch.setattr(fa3gen.bench, "main", lambda argv: seen.append(argv) or 7)
    assert main(["bench", "--quick", "--x", "1"]) == 7
    assert seen == [["--quick", "--x", "1"]]
