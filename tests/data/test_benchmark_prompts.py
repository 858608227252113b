"""Benchmark prompt sets: fetched from a (fake) Hugging Face dataset repo like weights, verified and resumable, and
named by `train --eval-prompts NAME`."""

from __future__ import annotations

import json

import pytest
from fakehub import FakeHub, FakeRepo, isolate_hub_environment

from fluxgrpo.config import build_config
from fluxgrpo.data.benchmarks import BENCHMARKS, benchmark_path
from fluxgrpo.data.prompts import read_prompts
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.hub import FetchRequest, fetch_from_hub
from fluxgrpo.weights.hub_parts import hub_parts

PROMPTS = [f"prompt number {i}, a photo" for i in range(400)]


@pytest.fixture(autouse=True)
def _isolated_hub_env(tmp_path, monkeypatch):
    isolate_hub_environment(tmp_path, monkeypatch)


def served_hpdv2(tmp_path):
    folder = tmp_path / "served" / "hpdv2"
    folder.mkdir(parents=True)
    rows = [{"prompt": p, "image_path": [f"{i:05d}_0.jpg"], "rank": [1]} for i, p in enumerate(PROMPTS)]
    (folder / "test.json").write_text(json.dumps(rows))
    (folder / "test.tar.gz").write_bytes(b"not fetched: the images are not needed")
    return FakeRepo("zhwang/HPDv2", folder, repo_type="dataset")


def test_hpdv2_prompts_fetch_verify_and_read_as_the_eval_set(tmp_path, monkeypatch):
    repo = served_hpdv2(tmp_path)
    prompts_dir = tmp_path / "data" / "eval_prompts"
    with FakeHub("hf", [repo]) as hub:
        summary = fetch_from_hub(
            FetchRequest("hf", parts=["hpdv2-prompts"], prompts_dir=prompts_dir, endpoint=hub.url, progress=False)
        )
        assert [path for _, path, _ in hub.content_requests()] == ["test.json"]  # only the allow-listed file
        hub.reset_requests()
        again = fetch_from_hub(
            FetchRequest("hf", parts=["hpdv2-prompts"], prompts_dir=prompts_dir, endpoint=hub.url, progress=False)
        )
        assert hub.content_requests() == []  # a complete set downloads nothing
    assert summary.parts[0].files_downloaded == 1 and again.parts[0].files_downloaded == 0
    path = benchmark_path("hpdv2", prompts_dir)
    assert (path.parent / "manifest.json").is_file()
    assert read_prompts(path) == PROMPTS and len(PROMPTS) == BENCHMARKS["hpdv2"].prompts
    monkeypatch.chdir(tmp_path)  # --eval-prompts hpdv2 reads the default prompts folder
    assert build_config("tiny-cpu", {"eval_prompts": "hpdv2", "eval_every": 2}).eval_prompts == "hpdv2"


def test_a_model_repo_of_the_same_name_is_not_taken_for_the_dataset(tmp_path):
    repo = served_hpdv2(tmp_path)
    repo.repo_type = "model"
    with FakeHub("hf", [repo]) as hub, pytest.raises(FluxgrpoError):
        fetch_from_hub(
            FetchRequest("hf", parts=["hpdv2-prompts"], prompts_dir=tmp_path / "p", endpoint=hub.url, progress=False)
        )


def test_missing_benchmark_names_the_fetch_command_and_modelscope_has_no_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="fetch-weights --only hpdv2-prompts"):
        build_config("tiny-cpu", {"eval_prompts": "hpdv2", "eval_every": 2})
    with pytest.raises(UsageError, match="nor a benchmark name"):
        build_config("tiny-cpu", {"eval_prompts": "geneval", "eval_every": 2})
    assert hub_parts()["hpdv2-prompts"].repos["modelscope"] == ()
    with pytest.raises(UsageError, match="no known repository on modelscope"):
        fetch_from_hub(FetchRequest("modelscope", parts=["hpdv2-prompts"], prompts_dir=tmp_path / "p", progress=False))


def test_json_prompt_files_must_be_a_list_of_objects_with_a_prompt(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompt": "one"}))
    with pytest.raises(FluxgrpoError, match="list of objects"):
        read_prompts(bad)
