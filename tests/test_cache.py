"""Build and cache semantics with a tiny template (seconds per nvcc), so they never wait on the real kernel."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fa3gen
from fa3gen import REGISTRY, BuildError, JitDisabledError, KernelSpec, ToolchainError, cache
from fa3gen.build import build, build_many, parse_ptxas, ptxas_report
from fa3gen_testing import REPO, NvccCounter, write_templates

SPEC = REGISTRY["fwd_d128_bf16"]
OTHER = REGISTRY["fwd_d64_fp16_causal"]
pytestmark = pytest.mark.usefixtures("cache_dir", "mini_templates")


def test_miss_then_hit(cache_dir: Path, nvcc_counter: NvccCounter) -> None:
    first = build(SPEC)
    assert not first.cached and first.seconds > 0
    assert nvcc_counter.compiles == 1
    entry = first.entry_dir
    assert entry.parent == cache_dir and entry.name == f"{SPEC.name}-{first.key[:16]}"
    for name in ("kernel.cu", "kernel.so", "build.log", "spec.json", "manifest.json"):
        assert (entry / name).is_file(), name
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["files"]["kernel.so"]["size"] == (entry / "kernel.so").stat().st_size
    assert KernelSpec.from_json((entry / "spec.json").read_text()) == SPEC
    assert "ptxas info" in (entry / "build.log").read_text()

    second = build(SPEC)
    assert second.cached and second.entry_dir == entry
    kernel = fa3gen.compile(SPEC)
    assert kernel.entry_dir == entry and kernel.spec == SPEC
    assert kernel.library_path == entry / "kernel.so"
    assert fa3gen.compile(SPEC.canonical_json()) is kernel  # in-process memo, JSON accepted
    assert nvcc_counter.compiles == 1


def test_compiled_kernel_checks_abi(warm_cache: Path) -> None:
    kernel = fa3gen.compile(SPEC)
    kernel.fwd(fa3gen.abi.FwdParams(), 0)  # the mini kernel returns cudaSuccess without touching the GPU


def _corrupt_so(entry: Path) -> None:
    data = bytearray((entry / "kernel.so").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry / "kernel.so").write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage",
    [
        _corrupt_so,
        lambda e: _truncate(e / "kernel.so"),
        lambda e: _truncate(e / "manifest.json"),
        lambda e: (e / "manifest.json").unlink(),
        lambda e: (e / "kernel.so").unlink(),
    ],
    ids=["flipped-byte-so", "truncated-so", "truncated-manifest", "no-manifest", "no-so"],
)
def test_damaged_entry_is_rebuilt(warm_cache: Path, nvcc_counter: NvccCounter, damage) -> None:
    entry = build(SPEC).entry
    assert entry.is_valid() and nvcc_counter.compiles == 0
    damage(entry.path)
    assert not entry.is_valid()
    again = build(SPEC)
    assert not again.cached and again.entry_dir == entry.path
    assert entry.is_valid()
    assert nvcc_counter.compiles == 1


def test_wrong_spec_in_library_is_rebuilt(warm_cache: Path, nvcc_counter: NvccCounter) -> None:
    # An entry whose files match its manifest but whose library embeds another spec is corrupt too.
    entry = build(SPEC).entry
    other = build(OTHER).entry
    (entry.path / "kernel.so").write_bytes(other.library.read_bytes())
    cache.write_manifest(entry.path, key="forged")
    assert entry.is_valid()
    kernel = fa3gen.compile(SPEC)
    assert kernel.entry_dir == entry.path
    assert nvcc_counter.compiles == 1


_CHILD = """
import os, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.01)
import fa3gen
print(fa3gen.compile(fa3gen.REGISTRY["fwd_d128_bf16"]).entry_dir)
"""


def test_concurrent_processes_build_once(tmp_path: Path, nvcc_counter: NvccCounter) -> None:
    nvcc_counter.write(delay=1.0)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(go)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    time.sleep(0.5)
    go.touch()  # release all three at once
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({out.strip() for out, _ in outs}) == 1
    assert nvcc_counter.compiles == 1


def test_parallel_build_many(nvcc_counter: NvccCounter) -> None:
    nvcc_counter.write(delay=1.0)
    lines: list[str] = []
    results = build_many([SPEC, OTHER, SPEC], jobs=2, progress=lines.append)
    assert [r.spec for r in results] == [SPEC, OTHER]
    assert nvcc_counter.compiles == 2
    (s1, e1), (s2, e2) = nvcc_counter.intervals()
    assert s2 < e1, "the two nvcc runs did not overlap"
    assert any("built in" in line for line in lines)
    assert all(r.entry.is_valid() for r in results)


def test_no_jit_names_the_spec(monkeypatch: pytest.MonkeyPatch, nvcc_counter: NvccCounter) -> None:
    monkeypatch.setenv("FA3GEN_NO_JIT", "1")
    with pytest.raises(JitDisabledError) as info:
        fa3gen.compile(SPEC)
    assert SPEC.name in str(info.value) and SPEC.canonical_json() in str(info.value)
    assert nvcc_counter.compiles == 0
    monkeypatch.delenv("FA3GEN_NO_JIT")
    build(SPEC)
    monkeypatch.setenv("FA3GEN_NO_JIT", "1")
    assert fa3gen.compile(SPEC).spec == SPEC  # a cached entry still loads


def test_nvcc_failure_shows_message_and_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = write_templates(tmp_path / "broken", "int broken( { this is not C++ }\n// {{ spec.name }}\n")
    monkeypatch.setenv("FA3GEN_TEMPLATES_DIR", str(broken))
    with pytest.raises(BuildError) as info:
        fa3gen.compile(SPEC)
    message = str(info.value)
    assert "error" in message and SPEC.name in message
    source = Path(message.split("generated source: ")[1].split()[0])
    assert source.is_file() and "this is not C++" in source.read_text()
    assert (source.parent / "build.log").is_file()


def test_missing_nvcc_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FA3GEN_NVCC", "/nonexistent/nvcc")
    with pytest.raises(ToolchainError, match="FA3GEN_NVCC=/nonexistent/nvcc"):
        fa3gen.compile(SPEC)


def test_prebuilt_entry_loads_without_nvcc(warm_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A deployment with a prebuilt cache and no CUDA toolkit: the entry is found by its source.
    monkeypatch.setenv("FA3GEN_NVCC", "/nonexistent/nvcc")
    monkeypatch.setenv("FA3GEN_NO_JIT", "1")
    assert fa3gen.compile(SPEC).spec == SPEC
    missing = REGISTRY["fwd_d256_fp16"]
    with pytest.raises(JitDisabledError, match=missing.name):
        fa3gen.compile(missing)


def test_key_covers_its_inputs() -> None:
    base = dict(source="s", headers="h", flags=["-O3"], nvcc_version="n", cutlass_version="c",
                fa3gen_version="f")
    key = cache.cache_key(**base)
    for field, value in [("source", "s2"), ("headers", "h2"), ("flags", ["-O2"]), ("nvcc_version", "n2"),
                         ("cutlass_version", "c2"), ("fa3gen_version", "f2")]:
        assert cache.cache_key(**{**base, field: value}) != key, field


def test_header_change_changes_key(mini_templates: Path, nvcc_counter: NvccCounter) -> None:
    first = build(SPEC)
    with open(mini_templates / "include" / "fa3gen" / "abi.h", "a") as f:
        f.write("// edited\n")
    second = build(SPEC)
    assert second.key != first.key and not second.cached


def test_list_and_clear(warm_cache: Path, nvcc_counter: NvccCounter) -> None:
    build_many([SPEC, OTHER])
    assert nvcc_counter.compiles == 0
    names = sorted(e.path.name.split("-")[0] for e in cache.list_entries())
    assert names == sorted([SPEC.name, OTHER.name])
    assert cache.clear() == 2
    assert cache.list_entries() == []
    assert not build(SPEC).cached


def test_ptxas_report_of_entry(warm_cache: Path) -> None:
    (info,) = ptxas_report(build(SPEC).entry)
    assert "fa3gen_test_kernel" in info.function and info.arch == "sm_90a"
    assert info.registers > 0 and info.spill_stores == 0 and info.spill_loads == 0


def test_parse_ptxas_sample() -> None:
    log = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90a'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, 352 bytes cmem[0]
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function '_Z3fooPf'
"""
    foo, bar = parse_ptxas(log)
    assert foo.wgmma_serialized == "insufficient register resources" and bar.wgmma_serialized is None
    assert "WGMMA SERIALIZED" in foo.summary() and "SERIALIZED" not in bar.summary()
    assert (foo.function, foo.registers, foo.smem_bytes, foo.barriers) == ("_Z3fooPf", 168, 1024, 1)
    assert (foo.stack_frame, foo.spill_stores, foo.spill_loads) == (16, 8, 4)
    assert (bar.registers, bar.smem_bytes, bar.spill_stores) == (8, 0, 0)


def test_serialized_wgmma_is_reported_and_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ptxas's C7512 (the WGMMAs serialized: a correct kernel at a fraction of its speed) reaches the
    report and a SerializedWgmmaWarning naming the spec. The mini kernel has no WGMMA, so an nvcc
    wrapper adds the line ptxas prints, for the entry function it compiled."""
    from fa3gen import toolchain

    wrapper = tmp_path / "nvcc"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'out=$("{toolchain.find_nvcc()}" "$@" 2>&1); rc=$?\n'
        "printf '%s\\n' \"$out\"\n"
        "fn=$(printf '%s\\n' \"$out\" | sed -n \"s/.*Compiling entry function '\\([^']*\\)'.*/\\1/p\" | head -n 1)\n"
        '[ -n "$fn" ] && echo "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions '
        "are serialized due to insufficient register resources for the function '$fn'\"\n"
        "exit $rc\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FA3GEN_NVCC", str(wrapper))
    with pytest.warns(fa3gen.SerializedWgmmaWarning, match=SPEC.name):
        result = build(SPEC)
    (info,) = ptxas_report(result)
    assert info.wgmma_serialized == "insufficient register resources"
