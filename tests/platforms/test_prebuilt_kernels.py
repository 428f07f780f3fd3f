"""The cpu platform's prebuilt kernel libraries (platforms/cpu_kernels/prebuilt.py): which ISA level a CPU
gets, the checks that refuse a library built for another torch or from other sources, the opt-outs, and a
prebuilt library loaded in place of a build (a one-function probe here; one real kernel library, in a fresh
process with an empty kernel cache, in the slow test)."""
from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys

import pytest
import torch

from halserve.platforms import cpu_kernels
from halserve.platforms.cpu_kernels import build, prebuilt
from halserve.platforms.cpu_kernels.panel import cpu_flags

V3 = {"ssse3", "sse4_2", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
      "xsave", "sse", "sse2"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ZEN4 = V4 | {"avx512_vnni", "avx512_bf16", "avx512_bitalg", "avx512ifma"}
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
THIS_LEVEL = prebuilt.cpu_level(cpu_flags())
NO_TOOLCHAIN = cpu_kernels.toolchain_missing()
PROBE = 'extern "C" int halserve_prebuilt_probe() { return %d; }\n'


@pytest.mark.parametrize("flags, expected", [
    (set(), None),
    (V3 - {"fma"}, None),  # AVX2 without FMA: not x86-64-v3
    (V3, "avx2"),
    (V4 - {"avx512cd"}, "avx2"),
    (V4, "avx512"),  # Skylake-X, Ice Lake
    (V4 | {"avx512_vnni"}, "avx512"),  # Cascade Lake: VNNI without BF16
    (ZEN4, "avx512_bf16"),
    (ZEN4 | {"amx_tile", "amx_bf16"}, "avx512_bf16"),  # no AMX-INT8: not the amx level
    (SPR, "amx"),
])
def test_a_cpu_gets_the_highest_level_its_flags_cover(flags, expected):
    level = prebuilt.cpu_level(frozenset(flags))
    assert (level.name if level else None) == expected


def _macros(flags: tuple[str, ...]) -> set[str]:
    out = subprocess.run(["c++", *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@pytest.mark.skipif(NO_TOOLCHAIN is not None or platform.machine() != "x86_64", reason="needs g++ on x86-64")
def test_each_level_compiles_exactly_the_kernel_paths_it_is_named_for():
    # the macros the kernels' #if guards test (vec16.h, panel_gemm.h, int8_gemm.cpp, amx.h)
    guards = ["__AVX2__", "__AVX512F__", "__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__", "__AMX_INT8__"]
    expected = {"avx2": guards[:1], "avx512": guards[:2], "avx512_bf16": guards[:3], "amx": guards}
    for level in prebuilt.LEVELS:
        defined = _macros(level.march)
        assert [g for g in guards if g in defined] == expected[level.name], level.name
        assert "__AVX512FP16__" not in defined, f"{level.name} would use AVX512-FP16, which no level's CPU flags ask"


def test_levels_parse_and_a_bad_name_is_refused():
    assert [level.name for level in prebuilt.parse_levels("avx2, avx512_bf16")] == ["avx2", "avx512_bf16"]
    assert [level.name for level in prebuilt.parse_levels("all")] == list(prebuilt.LEVEL_NAMES)
    with pytest.raises(ValueError, match="unknown ISA level 'avx1024'.*avx2, avx512"):
        prebuilt.parse_levels("avx2,avx1024")


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A prebuilt folder (manifest and a stand-in .so) holding library 'probe' for the avx512_bf16 level,
    built for this torch and Python, and the environment pointed at it."""
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE % 1)
    root = tmp_path / "prebuilt_libs"
    (root / "avx512_bf16").mkdir(parents=True)
    (root / "avx512_bf16" / "probe.so").write_bytes(b"")
    manifest = {"format": prebuilt.FORMAT, "torch": torch.__version__, "python": sys.implementation.cache_tag,
                "machine": platform.machine(), "levels": {"avx512_bf16": {"libraries": {"probe": {
                    "file": "avx512_bf16/probe.so", "source_hash": prebuilt.source_hash([str(source)]),
                    "is_python_module": False}}}}}
    (root / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv(prebuilt.USE_ENV, str(root))
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    return root, source, manifest


def _rewrite(root, manifest):
    (root / prebuilt.MANIFEST).write_text(json.dumps(manifest))


def test_a_matching_library_is_found_for_this_cpus_level(shipped):
    root, source, _ = shipped
    found = prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4))
    assert isinstance(found, prebuilt.Prebuilt), found
    assert (found.level, found.path, found.torch_version) == ("avx512_bf16", str(root / "avx512_bf16" / "probe.so"),
                                                              torch.__version__)
    assert prebuilt.usable_level(frozenset(ZEN4)) == "avx512_bf16"


def test_a_library_built_for_another_torch_is_refused(shipped):
    root, source, manifest = shipped
    _rewrite(root, dict(manifest, torch="2.12.0+cpu"))
    reason = prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4))
    assert reason == f"they were built for torch 2.12.0+cpu, this is torch {torch.__version__}"
    assert prebuilt.usable_level(frozenset(ZEN4)) is None


def test_a_library_built_for_another_python_is_refused(shipped):
    root, source, manifest = shipped
    _rewrite(root, dict(manifest, python="cpython-39"))
    assert "built for Python cpython-39" in prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4))


def test_edited_sources_refuse_the_prebuilt_library(shipped):
    root, source, _ = shipped
    assert isinstance(prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4)), prebuilt.Prebuilt)
    source.write_text(PROBE % 2)
    assert prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4)) == (
        "probe's sources differ from those the prebuilt avx512_bf16 library was built from")
    source.write_text(PROBE % 1)
    (source.parent / "added.h").write_text("#pragma once\n")  # a header beside the sources is part of the hash
    assert "sources differ" in prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4))
    # so are the -D flags
    (source.parent / "added.h").unlink()
    assert "sources differ" in prebuilt.find("probe", [str(source)], ("X=1",), flags=frozenset(ZEN4))


def test_a_cpu_of_another_level_builds_rather_than_loading_a_lower_or_higher_set(shipped):
    _, source, _ = shipped
    assert prebuilt.find("probe", [str(source)], flags=frozenset(SPR)) == (
        "this CPU's level is amx and they hold avx512_bf16 (a lower level would lose this CPU's kernels)")
    assert "this CPU's level is avx2" in prebuilt.find("probe", [str(source)], flags=frozenset(V3))
    assert "lacks AVX2" in prebuilt.find("probe", [str(source)], flags=frozenset())
    assert prebuilt.find("other", [str(source)], flags=frozenset(ZEN4)).endswith("has no other")


def test_opt_outs_and_an_install_without_prebuilt_libraries(shipped, monkeypatch, tmp_path):
    _, source, _ = shipped
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
    assert prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4)) == (
        "HALSERVE_CPU_MARCH=x86-64-v3 asks for a build for that target")
    assert prebuilt.usable_level(frozenset(ZEN4)) is None
    monkeypatch.delenv(build.MARCH_ENV)
    monkeypatch.setenv(prebuilt.USE_ENV, "0")
    assert prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4)) == "HALSERVE_PREBUILT_KERNELS=0 turns them off"
    monkeypatch.setenv(prebuilt.USE_ENV, str(tmp_path / "nowhere"))
    assert prebuilt.find("probe", [str(source)], flags=frozenset(ZEN4)).startswith("there are none in")
    monkeypatch.delenv(prebuilt.USE_ENV)
    assert prebuilt.prebuilt_root() == os.path.join(os.path.dirname(prebuilt.__file__), "prebuilt_libs")


def test_prebuilt_libraries_need_no_toolchain(shipped, monkeypatch):
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda tool: None)
    monkeypatch.setattr(prebuilt, "_cpu_flags", lambda: frozenset(ZEN4))
    assert cpu_kernels.toolchain_missing() is None
    monkeypatch.setenv(prebuilt.USE_ENV, "0")
    assert cpu_kernels.toolchain_missing() == "g++ is not installed (needed to build halserve's native CPU kernels)"


def test_every_library_is_shipped():
    names = [lib.build_name for lib in cpu_kernels.prebuilt_libraries()]
    assert set(names) >= {lib.build_name for lib in cpu_kernels.LIBRARIES.values()} | {"halserve_cpu_gguf_gemm"}
    assert len(names) == len(set(names))
    for lib in cpu_kernels.prebuilt_libraries():
        assert all(os.path.isfile(os.path.join(prebuilt.HERE, s)) for s in lib.sources), lib


@pytest.mark.skipif(NO_TOOLCHAIN is not None or THIS_LEVEL is None, reason="needs g++ and an x86-64-v3+ CPU")
@pytest.mark.timeout(120)
def test_a_prebuilt_library_loads_in_place_of_a_build(tmp_path, monkeypatch, caplog):
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE % 7)
    root = tmp_path / "prebuilt_libs"
    manifest = prebuilt.prebuild(str(root), [THIS_LEVEL], [prebuilt.LibrarySpec("hs_prebuilt_probe", (str(source),))],
                                 log=lambda line: None)
    assert manifest["torch"] == torch.__version__ and list(manifest["levels"]) == [THIS_LEVEL.name]
    monkeypatch.setenv(prebuilt.USE_ENV, str(root))
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        path = build.build_and_load("hs_prebuilt_probe", [str(source)], is_python_module=False)
    assert path == str(root / THIS_LEVEL.name / "hs_prebuilt_probe.so")
    assert not (tmp_path / "cache").exists(), "nothing is built or cached"
    assert f"using prebuilt {THIS_LEVEL.name} kernels for torch {torch.__version__}" in caplog.text
    import ctypes

    assert ctypes.CDLL(path).halserve_prebuilt_probe() == 7


@pytest.mark.skipif(NO_TOOLCHAIN is not None or THIS_LEVEL is None, reason="needs g++ and an x86-64-v3+ CPU")
@pytest.mark.timeout(120)
def test_a_stale_prebuilt_library_is_built_instead_and_the_log_says_why(tmp_path, monkeypatch, caplog):
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE % 7)
    root = tmp_path / "prebuilt_libs"
    prebuilt.prebuild(str(root), [THIS_LEVEL], [prebuilt.LibrarySpec("hs_prebuilt_stale", (str(source),))],
                      log=lambda line: None)
    source.write_text(PROBE % 8)  # the checkout's source was edited after the wheel was built
    monkeypatch.setenv(prebuilt.USE_ENV, str(root))
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        path = build.build_and_load("hs_prebuilt_stale", [str(source)], is_python_module=False)
    assert path.startswith(str(tmp_path / "cache"))
    assert "hs_prebuilt_stale's sources differ from those the prebuilt" in caplog.text
    import ctypes

    assert ctypes.CDLL(path).halserve_prebuilt_probe() == 8


# the child: the GGUF GEMM through its kernel, from whatever build_and_load picks; prints where from
_GGUF_CHILD = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from halserve.kernels.gguf_blocks import random_blocks
from halserve.platforms.cpu_kernels.native_gguf import NativeGgufGemm
g = torch.Generator().manual_seed(0)
w = random_blocks("Q8_0", 33, 256, g)
x = torch.randn(5, 256, generator=g)
torch.save(NativeGgufGemm()(x, w, "Q8_0"), sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.extended  # compiles the GGUF library (~15 s on 2 cores) and starts two processes
@pytest.mark.skipif(NO_TOOLCHAIN is not None or THIS_LEVEL is None, reason="needs g++ and an x86-64-v3+ CPU")
@pytest.mark.timeout(300)
def test_a_fresh_process_with_an_empty_cache_loads_the_prebuilt_gguf_library(tmp_path):
    lib = cpu_kernels.GGUF_LIBRARY
    root = tmp_path / "prebuilt_libs"
    prebuilt.prebuild(str(root), [THIS_LEVEL], [prebuilt.LibrarySpec(
        lib.build_name, tuple(os.path.join(prebuilt.HERE, s) for s in lib.sources), lib.defines,
        lib.is_python_module)], log=lambda line: None)
    env = {k: v for k, v in os.environ.items() if k not in (build.MARCH_ENV, "HALSERVE_GGUF_ISA")}
    runs = {}
    for what, extra in (("prebuilt", {prebuilt.USE_ENV: str(root), build.CACHE_ENV: str(tmp_path / "empty")}),
                        ("built", {prebuilt.USE_ENV: "0"})):
        out = tmp_path / f"{what}.pt"
        proc = subprocess.run([sys.executable, "-c", _GGUF_CHILD, str(out)], env=dict(env, **extra),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[what] = (torch.load(out), proc.stdout + proc.stderr)
    log = runs["prebuilt"][1]
    assert f"using prebuilt {THIS_LEVEL.name} kernels for torch {torch.__version__}" in log, log[-2000:]
    assert "building " not in log, log[-2000:]
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir()), "it compiled"
    assert "not using a prebuilt" in runs["built"][1] and "turns them off" in runs["built"][1]
    # same instruction path as -march=native on this CPU (the kernel picks it at run time): same numbers
    assert torch.equal(runs["prebuilt"][0], runs["built"][0])
