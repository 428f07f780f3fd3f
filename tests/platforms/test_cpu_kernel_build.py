"""The native CPU kernels' build (platforms/cpu_kernels/build.py) survives what hung CI before: a lock
left by a process killed mid-build, and other processes building at the same time."""
import fcntl
import os
import threading

import pytest

from halserve.platforms.cpu_kernels import build, toolchain_missing

pytestmark = pytest.mark.skipif(toolchain_missing() is not None, reason=f"no C++ toolchain: {toolchain_missing()}")

SOURCE = "extern \"C\" int halserve_build_probe() { return %d; }\n"


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A one-function C++ source (no torch headers: builds in about a second) and a private cache."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    source = tmp_path / "probe.cpp"
    source.write_text(SOURCE % 1)
    return str(source)


def _directory(name, source):
    return os.path.join(build.extensions_root(), f"{name}_{build.build_key([source])}")


@pytest.mark.timeout(120)
def test_a_stale_torch_lock_is_cleared_not_waited_on(probe):
    directory = _directory("probe_stale", probe)
    os.makedirs(directory)
    open(os.path.join(directory, "lock"), "w").close()  # what a process killed mid-build leaves
    library = build.build_and_load("probe_stale", [probe], is_python_module=False)
    assert os.path.isfile(library) and library.startswith(directory)
    assert not os.path.exists(os.path.join(directory, "lock"))


@pytest.mark.timeout(120)
def test_a_second_builder_waits_for_the_first(probe):
    directory = _directory("probe_wait", probe)
    os.makedirs(directory)
    results = []
    with open(directory + ".flock", "a+") as held:  # another process building the same input
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: results.append(
            build.build_and_load("probe_wait", [probe], is_python_module=False)))
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and not results, "the build ran while another process held the lock"
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(timeout=100)
    assert results and os.path.isfile(results[0])


def test_changed_sources_build_in_their_own_directory(probe, tmp_path):
    first = build.build_key([probe])
    other = tmp_path / "other" / "probe.cpp"
    other.parent.mkdir()
    other.write_text(SOURCE % 2)
    assert build.build_key([str(other)]) != first
    same = tmp_path / "same" / "probe.cpp"
    same.parent.mkdir()
    same.write_text(SOURCE % 1)
    assert build.build_key([str(same)]) == first  # a clean clone of the same sources reuses the build


def test_the_key_covers_the_headers_that_are_staged(probe, tmp_path):
    """The cache key hashes exactly what ``stage_sources`` copies: the sources and the headers beside them
    (a source in another folder than the bundled kernels brings its own headers)."""
    header = tmp_path / "probe.h"
    header.write_text("#define HALSERVE_PROBE 1\n")
    first = build.build_key([probe])
    header.write_text("#define HALSERVE_PROBE 2\n")
    assert build.build_key([probe]) != first  # a header change is a new build
    staged = build.stage_sources(str(tmp_path / "stage"), [probe])
    assert staged == [str(tmp_path / "stage" / "src" / "probe.cpp")]
    assert sorted(os.listdir(tmp_path / "stage" / "src")) == ["probe.cpp", "probe.h"]
    assert (tmp_path / "stage" / "src" / "probe.h").read_text() == header.read_text()
