"""A model argument that looks like a local path and does not exist: 'no such file or directory: PATH',
never the Hugging Face hub's repo-id error."""
from __future__ import annotations

import os

import pytest

from halserve.config import EngineConfig
from halserve.models.loader import get_model_info, resolve_model_path
from halserve.models.model_path import ModelPathNotFoundError, check_local_path, looks_like_local_path


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything asks the hub (a path must never get that far)."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


@pytest.mark.parametrize("model", ["/no/such/model", "./missing-model", "../missing-model", "~/no-such-halserve-model"])
def test_path_prefixes_look_local(model):
    assert looks_like_local_path(model)


def test_existing_parent_folder_looks_local(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert looks_like_local_path("models/llama")  # ./models exists: a path
    assert not looks_like_local_path("Qwen/Qwen2.5-0.5B-Instruct")  # no ./Qwen: a hub id
    assert not looks_like_local_path("gpt2")


@pytest.mark.parametrize("model", ["/no/such/model", "./missing-model", "~/no-such-halserve-model"])
def test_missing_path_is_a_file_system_error(model, no_hub):
    with pytest.raises(ModelPathNotFoundError, match=f"^no such file or directory: {model} ") as info:
        resolve_model_path(model)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)


def test_missing_path_under_an_existing_folder(tmp_path, monkeypatch, no_hub):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPathNotFoundError, match="no such file or directory: models/llama"):
        resolve_model_path("models/llama")


def test_existing_paths_and_hub_ids_pass(tmp_path):
    check_local_path(str(tmp_path))
    check_local_path("Qwen/Qwen2.5-0.5B-Instruct")


def test_engine_model_info_reports_the_path(tmp_path, no_hub):
    from halserve.platforms import resolve_platform

    missing = str(tmp_path / "llama-3-8b")
    with pytest.raises(ModelPathNotFoundError, match=f"no such file or directory: {missing}"):
        get_model_info(EngineConfig(model=missing), resolve_platform("cpu"))


def test_cli_serve_missing_path_exits_2(tmp_path, capsys, no_hub):
    from halserve.entrypoints.cli import main

    missing = os.path.join(str(tmp_path), "my-model")
    assert main(["serve", missing, "--platform", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"no such file or directory: {missing}" in err
    assert "repo id" not in err.lower() and "hugging face hub (" not in err.lower()
