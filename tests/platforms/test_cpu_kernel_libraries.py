"""The native CPU kernels build lazily, one library per need (platforms/cpu_kernels/__init__.py's
LIBRARIES), and say truthfully what they do: "building ..." with progress on a first build, "using
cached build ..." afterwards. The library tests fake the compile (the real libraries take minutes);
the log tests build a one-function probe (about a second)."""
import ctypes
import logging
import os

import pytest

from halserve.platforms import cpu_kernels
from halserve.platforms.cpu_kernels import build, toolchain_missing

needs_toolchain = pytest.mark.skipif(toolchain_missing() is not None, reason=f"no C++ toolchain: {toolchain_missing()}")


class _FakeCore:
    """Stands in for the core library's pybind module: the fused kernels only keep a reference at init."""


@pytest.fixture
def builds(monkeypatch):
    """Record each library build instead of compiling; a fresh per-process library table."""
    built = []

    def fake_build_and_load(name, sources, *, is_python_module=True, defines=(), label=None, purpose="",
                            estimate_s=None):
        built.append((name, [os.path.basename(s) for s in sources], defines))
        if name != "halserve_cpu_core":
            raise RuntimeError(f"{name} is not compiled in this test")
        return _FakeCore()

    monkeypatch.setattr(build, "build_and_load", fake_build_and_load)
    monkeypatch.setattr(cpu_kernels, "toolchain_missing", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_errors", {})
    return built


def test_registering_the_cpu_kernels_builds_nothing(builds):
    from halserve.plugins import get_plugin_manager

    assert [k for k in get_plugin_manager().kernels if "cpu" in k.obj.platforms]  # the classes are registered
    assert builds == []


def test_a_float_model_s_ops_build_the_core_library_only(builds):
    from halserve.kernels.resolve import resolve_kernel

    for op, problem in [("rms_norm", {}), ("rotary_embedding", {"head_size": 64, "rotary_dim": 64, "is_neox": True}),
                        ("silu_and_mul", {"intermediate_size": 256})]:
        kernel = resolve_kernel(op, "cpu", dtype="float32", **problem)
        assert kernel.name == "cpu_fused", (op, kernel.name)
    assert [name for name, _, _ in builds] == ["halserve_cpu_core"]  # once, though three kernels use it
    assert cpu_kernels.loaded_libraries() == ["core"]


def test_a_4bit_kernel_builds_its_own_library_on_first_use(builds):
    from halserve.platforms.cpu_kernels.native_int4 import NativeInt4GptqGemm

    with pytest.raises(RuntimeError, match="int4.*not compiled in this test"):
        NativeInt4GptqGemm()
    name, sources, defines = builds[-1]
    assert name == "halserve_cpu_int4" and "int4_gemm.cpp" in sources and "panel_gemm.cpp" in sources
    assert defines == ("HALSERVE_PANEL_ISA_OP=int4_panel_gemm_isa",)  # its own name for the shared ISA query
    assert "halserve_cpu_fp8" not in [n for n, _, _ in builds] and "halserve_cpu_core" not in [n for n, _, _ in builds]
    with pytest.raises(RuntimeError, match="int4"):  # the failure is remembered, not rebuilt per layer
        NativeInt4GptqGemm()
    assert len(builds) == 1


def test_libraries_that_share_the_panel_gemm_name_its_op_apart():
    shared = [lib for lib in cpu_kernels.LIBRARIES.values() if "panel_gemm.cpp" in lib.sources]
    ops = [d for lib in shared for d in lib.defines if d.startswith("HALSERVE_PANEL_ISA_OP=")]
    assert len(shared) >= 2 and len(ops) == len(shared) == len(set(ops))
    for lib in cpu_kernels.LIBRARIES.values():
        for source in lib.sources:
            assert os.path.isfile(os.path.join(build.HERE, source)), source


def test_an_unknown_library_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown native CPU kernel library 'int3'.*core"):
        cpu_kernels.load_library("int3")


def test_progress_line_counts_compiled_sources_and_the_time_left(tmp_path):
    sources = [str(tmp_path / "a.cpp"), str(tmp_path / "b.cpp")]
    (tmp_path / "a.o").write_bytes(b"")
    started = build.time.monotonic() - 20
    line = build.progress_line("kernels 'int4'", str(tmp_path), sources, started, 70.0)
    assert line.startswith("building kernels 'int4': 1 of 2 sources compiled, 20 s elapsed, about 50 s left of ~70 s")
    assert "past the ~10 s estimate" in build.progress_line("x", str(tmp_path), sources, started, 10.0)
    assert "no estimate yet" in build.progress_line("x", str(tmp_path), sources, started, None)


def test_the_cache_folder_can_be_pointed_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert build.extensions_root() == str(tmp_path / "torch")
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "halserve"))
    assert build.extensions_root() == str(tmp_path / "halserve")  # ours wins


@needs_toolchain
@pytest.mark.timeout(120)
def test_first_build_reports_progress_and_the_second_says_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.02)
    source = tmp_path / "probe.cpp"
    # (std::regex: a compile of ~1 s, so that a progress report (every 0.02 s here) sees it unfinished even on a
    # fast CPU, where a one-line source compiled before the first report)
    source.write_text("#include <regex>\nextern \"C\" int halserve_build_probe() "
                      "{ return std::regex_match(\"3\", std::regex(\"[0-9]\")) ? 3 : 0; }\n")
    caplog.set_level(logging.INFO, logger=build.__name__)

    first = build.build_and_load("probe_log", [str(source)], is_python_module=False, label="the probe",
                                 purpose="a test", estimate_s=5)
    text = caplog.text
    assert "building the probe (a test): 1 sources (probe.cpp), once per machine and source version, about 5 s" in text
    assert "building the probe: 0 of 1 sources compiled" in text  # progress while the compiler runs
    assert "built the probe in" in text
    assert "using cached build" not in text
    assert os.path.isfile(first)
    assert build.recorded_build_seconds("probe_log") is not None  # the next first build's estimate

    caplog.clear()
    second = build.build_and_load("probe_log", [str(source)], is_python_module=False, label="the probe")
    assert second == first
    assert "using cached build of the probe" in caplog.text
    assert "building" not in caplog.text


@needs_toolchain
@pytest.mark.timeout(180)
def test_the_same_sources_from_another_checkout_load_without_a_rebuild(tmp_path):
    """Two copies of the same sources (a second checkout, a CI clone, an installed wheel) share one
    build: it compiles from staged copies, so neither copy's path makes ninja rebuild it for the other
    (each load its own process, as torch only runs ninja once per process), and a load that did
    recompile says so instead of "using cached build"."""
    import subprocess
    import sys

    copies = []
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        (tmp_path / checkout / "probe.h").write_text("#define PROBE_VALUE 4\n")
        source = tmp_path / checkout / "probe.cpp"
        source.write_text("#include \"probe.h\"\nextern \"C\" int halserve_build_probe() { return PROBE_VALUE; }\n")
        copies.append(str(source))
    env = {**os.environ, build.CACHE_ENV: str(tmp_path / "cache")}

    def load(source: str) -> tuple[str, str]:
        code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
                "from halserve.platforms.cpu_kernels import build\n"
                f"print('LIB', build.build_and_load('probe_two', [{source!r}], is_python_module=False))\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                             cwd=str(tmp_path))
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout.split("LIB ")[-1].strip(), out.stdout

    first, log = load(copies[0])
    assert "building probe_two" in log
    built = os.stat(first).st_mtime_ns
    for source in (copies[1], copies[0], copies[1]):
        library, log = load(source)
        assert library == first and "using cached build of probe_two" in log, log
    assert os.stat(first).st_mtime_ns == built  # never recompiled
    assert ctypes.CDLL(first).halserve_build_probe() == 4

    # a load that did recompile (here: a staged copy newer than the library) says so
    staged = os.path.join(os.path.dirname(first), "src", "probe.cpp")
    os.utime(staged, ns=(built + 10**9, built + 10**9))
    _, log = load(copies[1])
    assert os.stat(first).st_mtime_ns != built
    assert "rebuilt probe_two" in log and "using cached build" not in log, log
