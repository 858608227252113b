"""``fluxgrpo fetch-weights --source hf|modelscope|tiny`` through the CLI, against the fake hubs (tests/fakehub.py).

Nothing here touches the network: HF_HOME and the ModelScope folders point at tmp dirs, tokens and endpoints from
the environment are removed, and every request goes to a loopback server that records it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fakehub import (
    CLIP_FILES,
    FLUX_DEV_FILES,
    HPS_FILES,
    FakeHub,
    FakeRepo,
    isolate_hub_environment,
    write_random_repo,
)
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.weights.layout import (
    HPS_MANIFEST,
    REWARD_ARCH_FILE,
    check_hps_dir,
    check_pickscore_dir,
    pickscore_dir,
)
from fluxgrpo.weights.manifest import MANIFEST_NAME, read_manifest

runner = CliRunner()

FLUX_ID = "black-forest-labs/FLUX.1-dev"
HPS_ID = {"hf": "xswu/HPSv2", "modelscope": "AI-ModelScope/HPSv2"}
CLIP_ID = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
PICKSCORE_ID = {"hf": "yuvalkirstain/PickScore_v1", "modelscope": "AI-ModelScope/PickScore_v1"}
PROCESSOR_ID = {"hf": CLIP_ID, "modelscope": "AI-ModelScope/CLIP-ViT-H-14-laion2B-s32B-b79K"}
FLUX_ROOT_FILES = {
    ".gitattributes",
    "README.md",
    "LICENSE.md",
    "dev_grid.jpg",
    "flux1-dev.safetensors",
    "ae.safetensors",
}
FLUX_WANTED = sorted(p for p in FLUX_DEV_FILES if p not in FLUX_ROOT_FILES)
# 242,198 bytes of FLUX diffusers files (tests/weights/test_fetch_hub.py spells out the sum) + 2,100 (HPS_v2.1_compressed.pt)
# + 3,900 (open_clip_pytorch_model.bin) = 248,198 bytes in 23 + 1 + 1 = 25 files.
DEFAULT_PARTS_BYTES = 248_198
PROCESSOR_FILES = ("merges.txt", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json")


@pytest.fixture(autouse=True)
def _isolated_hub_env(tmp_path, monkeypatch):
    isolate_hub_environment(tmp_path, monkeypatch)


def default_repos(tmp_path: Path, source: str, *, gated_flux: bool = False) -> list[FakeRepo]:
    served = tmp_path / "served"
    return [
        FakeRepo(FLUX_ID, write_random_repo(served / "flux", FLUX_DEV_FILES, seed=1), gated=gated_flux),
        FakeRepo(HPS_ID[source], write_random_repo(served / "hps", HPS_FILES, seed=2)),
        FakeRepo(CLIP_ID, write_random_repo(served / "clip", CLIP_FILES, seed=3)),
    ]


def pickscore_repos(tmp_path: Path, source: str, tiny_hps_dir: Path, *, with_safetensors: bool) -> list[FakeRepo]:
    """The tiny PickScore served as the two hub repos, with the neighbours the real repos have."""
    tiny = pickscore_dir(tiny_hps_dir)
    model_repo, processor_repo = tmp_path / "served" / "pickscore", tmp_path / "served" / "laion-clip"
    shutil.copytree(tiny / "model", model_repo, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    # The real repo has both weight files; a mirror might have only the .bin.
    from safetensors.torch import load_file

    torch.save(load_file(model_repo / "model.safetensors"), model_repo / "pytorch_model.bin")
    if not with_safetensors:
        (model_repo / "model.safetensors").unlink()
    (model_repo / "README.md").write_text("PickScore v1\n")
    write_random_repo(processor_repo, CLIP_FILES, seed=4)  # the open_clip and transformers weights of CLIP-H
    for name in PROCESSOR_FILES:
        shutil.copy(tiny / "processor" / name, processor_repo / name)
    return [FakeRepo(PICKSCORE_ID[source], model_repo), FakeRepo(PROCESSOR_ID[source], processor_repo)]


def fetch_args(hub: FakeHub, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fetch-weights",
        "--source",
        hub.flavour,
        "--endpoint",
        hub.url,
        "--flux-dir",
        str(tmp_path / "flux"),
        "--hps-dir",
        str(tmp_path / "hps_ckpt"),
        *extra,
    ]


def requested(hub: FakeHub) -> list[tuple[str, str]]:
    return [(repo, path) for repo, path, _ in hub.content_requests()]


# -- hub sources -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_full_fetch_then_env_check_reports_the_weights_complete(tmp_path, source):
    with FakeHub(source, default_repos(tmp_path, source)) as hub:
        result = runner.invoke(app, fetch_args(hub, tmp_path))
        assert result.exit_code == 0, result.output
        assert "complete: 25 files in place; downloaded 25 (248.20 kB), 0 B already present" in result.stdout
        again = runner.invoke(app, fetch_args(hub, tmp_path, "--json"))
    assert again.exit_code == 0, again.output
    document = json.loads(again.stdout)
    assert (document["files"], document["files_downloaded"], document["bytes_present"]) == (25, 0, DEFAULT_PARTS_BYTES)
    assert [part["part"] for part in document["parts"]] == ["flux", "hps", "clip"]

    report = runner.invoke(
        app,
        [
            "env-check",
            "--json",
            "--flux-dir",
            str(tmp_path / "flux"),
            "--hps-dir",
            str(tmp_path / "hps_ckpt"),
            "--embeddings",
            str(tmp_path / "emb"),
        ],
    )
    checks = {c["name"]: c for c in json.loads(report.stdout)["checks"]}
    for part in ("flux", "hps", "clip"):
        assert checks[f"weights: {part}"]["status"] == "ok", checks[f"weights: {part}"]
        assert f"({source})" in checks[f"weights: {part}"]["detail"]
    assert checks["embeddings"]["status"] == "fail"  # not fetched by fetch-weights: env-check still exits 1
    assert report.exit_code == 1


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_dry_run_lists_the_files_and_the_total_and_writes_nothing(tmp_path, source):
    with FakeHub(source, default_repos(tmp_path, source)) as hub:
        table = runner.invoke(app, fetch_args(hub, tmp_path, "--dry-run"))
        as_json = runner.invoke(app, fetch_args(hub, tmp_path, "--dry-run", "--json"))
        assert requested(hub) == []
    assert table.exit_code == 0 and as_json.exit_code == 0, table.output + as_json.output
    assert not (tmp_path / "flux").exists() and not (tmp_path / "hps_ckpt").exists()
    assert "25 of 25 files to download, 248.20 kB of 248.20 kB (248198 bytes); nothing was written" in table.stdout
    assert "HPS_v2.1_compressed.pt" in table.stdout and "open_clip_pytorch_model.bin" in table.stdout
    plan = json.loads(as_json.stdout)["plan"]
    assert plan["bytes_to_fetch"] == DEFAULT_PARTS_BYTES
    listed = [(f["path"], f["size"], f["state"]) for f in plan["parts"][0]["files"]]
    assert listed == [(path, FLUX_DEV_FILES[path], "download") for path in FLUX_WANTED]


def test_a_gated_repo_without_a_token_exits_1_with_the_licence_message(tmp_path):
    with FakeHub("hf", default_repos(tmp_path, "hf", gated_flux=True)) as hub:
        result = runner.invoke(app, fetch_args(hub, tmp_path, "--only", "flux"))
    assert result.exit_code == 1
    assert (
        "gated (HTTP 401): accept the licence at https://huggingface.co/black-forest-labs/FLUX.1-dev" in result.stderr
    )
    assert "--token" in result.stderr
    assert not (tmp_path / "flux").exists()


def test_a_token_is_used_but_never_printed(tmp_path):
    secret = "hf_secret_token_0123456789"
    repos = default_repos(tmp_path, "hf", gated_flux=True)
    repos[0].granted_tokens = frozenset({secret})
    with FakeHub("hf", repos) as hub:
        result = runner.invoke(app, fetch_args(hub, tmp_path, "--only", "flux", "--token", secret))
        as_json = runner.invoke(app, fetch_args(hub, tmp_path, "--only", "flux", "--token", secret, "--json"))
    assert result.exit_code == 0 and as_json.exit_code == 0, result.output
    assert secret not in result.output + as_json.output
    assert secret not in (tmp_path / "flux" / MANIFEST_NAME).read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "flux,nope"], "unknown part 'nope'"),
        (["--only", ","], "--only needs at least one part"),
        (["--only", "pickscore", "--revision", "main"], "--revision pins one repository"),
        (["--seed", "3"], "--seed applies to --source tiny only"),
        (["--max-workers", "0"], "--max-workers must be at least 1"),
    ],
)
def test_bad_flags_with_a_hub_source_exit_2_before_any_request(tmp_path, args, message):
    with FakeHub("hf", default_repos(tmp_path, "hf")) as hub:
        result = runner.invoke(app, fetch_args(hub, tmp_path, *args))
        assert hub.requests == []
    assert result.exit_code == 2, result.output
    assert message in result.stderr


@pytest.mark.parametrize(
    "flag", [["--dry-run"], ["--revision", "main"], ["--endpoint", "http://127.0.0.1:9"], ["--only", "nope"]]
)
def test_hub_flags_and_unknown_parts_with_tiny_exit_2(tmp_path, flag):
    result = runner.invoke(
        app,
        [
            "fetch-weights",
            "--source",
            "tiny",
            "--flux-dir",
            str(tmp_path / "f"),
            "--hps-dir",
            str(tmp_path / "h"),
            *flag,
        ],
    )
    assert result.exit_code == 2, result.output
    assert flag[0] in result.stderr
    assert not (tmp_path / "f").exists() and not (tmp_path / "h").exists()


def test_real_hps_over_tiny_weights_removes_the_tiny_architecture_file(tmp_path):
    from fluxgrpo.rewards.open_clip_model import REAL_REWARD_ARCH, reward_model_name
    from fluxgrpo.rewards.tiny_weights import write_tiny_weights

    hps_dir = tmp_path / "hps_ckpt"
    write_tiny_weights(tmp_path / "flux", hps_dir, parts=["hps"])
    assert reward_model_name(hps_dir) != REAL_REWARD_ARCH
    with FakeHub("hf", default_repos(tmp_path, "hf")) as hub:
        result = runner.invoke(app, fetch_args(hub, tmp_path, "--only", "hps"))
    assert result.exit_code == 0, result.output
    assert not (hps_dir / REWARD_ARCH_FILE).exists()
    assert reward_model_name(hps_dir) == REAL_REWARD_ARCH  # the loader now builds ViT-H-14 for the fetched file
    assert read_manifest(hps_dir, HPS_MANIFEST).source == "hf"
    hps_status, clip_status = check_hps_dir(hps_dir)
    assert hps_status.complete and clip_status.source == "tiny"  # --only hps left the other part alone


# -- PickScore from the hubs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "with_safetensors"), [("hf", True), ("modelscope", False)])
def test_pickscore_from_a_hub_loads_as_the_reward_it_was_served_as(tmp_path, tiny_weights, source, with_safetensors):
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.rewards.pickscore import PickScoreReward

    torch.set_num_threads(1)
    repos = pickscore_repos(tmp_path, source, tiny_weights.hps_dir, with_safetensors=with_safetensors)
    with FakeHub(source, repos) as hub:
        result = runner.invoke(app, fetch_args(hub, tmp_path, "--only", "pickscore", "--json"))
        assert result.exit_code == 0, result.output
        weights = "model.safetensors" if with_safetensors else "pytorch_model.bin"
        assert sorted(requested(hub)) == sorted(
            [(PICKSCORE_ID[source], "config.json"), (PICKSCORE_ID[source], weights)]
            + [(PROCESSOR_ID[source], name) for name in PROCESSOR_FILES]
        )  # never the other weights file, the README, nor CLIP-H's own 4 GB weights
    document = json.loads(result.stdout)
    assert [part["part"] for part in document["parts"]] == ["pickscore-model", "pickscore-processor"]

    folder = pickscore_dir(tmp_path / "hps_ckpt")
    status = check_pickscore_dir(folder)
    assert status.complete and status.source == source, status.problems
    assert read_manifest(folder / "model").repo == PICKSCORE_ID[source]
    assert read_manifest(folder / "processor").repo == PROCESSOR_ID[source]

    images = torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(0))
    prompts = ["a red fox in the snow", "a castle at night"]
    fetched = load_reward("pickscore", tmp_path / "hps_ckpt")
    served = PickScoreReward(pickscore_dir(tiny_weights.hps_dir))
    torch.testing.assert_close(fetched(images, prompts), served(images, prompts), rtol=0, atol=0)


# -- tiny --------------------------------------------------------------------------------------------------------


def test_tiny_writes_every_part_including_pickscore(tmp_path):
    result = runner.invoke(
        app,
        [
            "fetch-weights",
            "--source",
            "tiny",
            "--flux-dir",
            str(tmp_path / "f"),
            "--hps-dir",
            str(tmp_path / "h"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Writing model shards" not in result.stderr  # save_pretrained's bars: our progress is the only one
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # silenced for the writing only: other code in this process keeps the libraries' bars
    assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()
    rows = json.loads(result.stdout)["parts"]
    assert [row["part"] for row in rows] == ["flux", "hps", "clip", "pickscore", "imagereward", "hpsv3"]
    assert all(row["complete"] and row["source"] == "tiny" and row["bytes"] > 0 for row in rows)
    assert rows[3]["path"] == str(tmp_path / "h" / "pickscore")
    assert rows[4]["path"] == str(tmp_path / "h" / "imagereward")
    assert rows[5]["path"] == str(tmp_path / "h" / "hpsv3")


def test_tiny_only_pickscore_writes_nothing_else(tmp_path):
    result = runner.invoke(
        app,
        [
            "fetch-weights",
            "--source",
            "tiny",
            "--only",
            "pickscore",
            "--flux-dir",
            str(tmp_path / "f"),
            "--hps-dir",
            str(tmp_path / "h"),
            "--seed",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "pickscore" in result.stdout and "complete" in result.stdout
    assert not (tmp_path / "f").exists()
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["pickscore"]
    assert check_pickscore_dir(tmp_path / "h" / "pickscore").complete


def test_a_hub_fetch_into_an_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with FakeHub("hf", default_repos(tmp_path, "hf")) as hub:
        args = fetch_args(hub, tmp_path)
        args[args.index("--flux-dir") + 1] = str(blocker / "flux")
        result = runner.invoke(app, args)
        assert hub.content_requests() == []  # refused before any download
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert f"cannot write weights to {blocker / 'flux'} (Not a directory)" in result.stderr
    assert "--flux-dir" in result.stderr


@pytest.mark.parametrize("full_at", ["copyfile", "torch.save"])
def test_shapes_on_a_full_disk_is_one_line_leaves_nothing_and_the_rerun_finishes(tmp_path, monkeypatch, full_at):
    import errno

    flux_dir, hps_dir = tmp_path / "data" / "flux", tmp_path / "hps_ckpt"
    argv = ["fetch-weights", "--source", "shapes", "--flux-dir", str(flux_dir), "--hps-dir", str(hps_dir)]
    real_copyfile, real_save = shutil.copyfile, torch.save
    copied: list[str] = []

    def copy_until_full(src, dst, *args, **kwargs):
        if len(copied) >= 2:  # some files are in place when the disk fills
            Path(dst).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        copied.append(str(src))
        return real_copyfile(src, dst, *args, **kwargs)

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file: file "
            "write failed (No space left on device)"
        )

    if full_at == "copyfile":
        monkeypatch.setattr(shutil, "copyfile", copy_until_full)
    else:
        monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    failed = runner.invoke(app, argv)
    assert failed.exit_code == 1, failed.output
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in failed.output and "[(" not in errors[0], failed.stderr
    assert "no space left on device writing into" in errors[0], errors[0]
    assert not [p for p in tmp_path.rglob("*") if ".fetching" in p.name]
    # nothing half-written where the weights go: a part there is complete (its manifest written) or absent
    assert not any(flux_dir.iterdir()) or read_manifest(flux_dir, MANIFEST_NAME) is not None
    assert not any(hps_dir.iterdir()) or read_manifest(hps_dir, HPS_MANIFEST) is not None

    monkeypatch.setattr(shutil, "copyfile", real_copyfile)  # space freed: the same command finishes
    monkeypatch.setattr(torch, "save", real_save)
    rerun = runner.invoke(app, argv)
    assert rerun.exit_code == 0, rerun.output
    assert read_manifest(flux_dir, MANIFEST_NAME) is not None and read_manifest(hps_dir, HPS_MANIFEST) is not None
    assert not [p for p in tmp_path.rglob("*") if ".fetching" in p.name]


def test_shapes_replaces_an_older_interrupted_copy_but_never_a_foreign_folder(tmp_path):
    """Before #50.2 the shapes FLUX was copied in place: a full disk left part of it without a manifest, and the
    rerun refused that folder. A folder holding nothing but part of the shipped files (one cut short) is replaced."""
    from fluxgrpo.shapes.shipped import shipped_weights_dir
    from fluxgrpo.shapes.sizes import FLUX_SUBDIR

    shipped = shipped_weights_dir() / FLUX_SUBDIR
    flux_dir, hps_dir = tmp_path / "flux", tmp_path / "hps_ckpt"
    copied = sorted(p for p in shipped.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)[:2]
    for source in copied:
        target = flux_dir / source.relative_to(shipped)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes()[: max(1, source.stat().st_size // 2)])  # cut short by the full disk
    argv = ["fetch-weights", "--source", "shapes", "--only", "flux", "--flux-dir", str(flux_dir)]
    result = runner.invoke(app, [*argv, "--hps-dir", str(hps_dir)])
    assert result.exit_code == 0, result.output
    assert read_manifest(flux_dir, MANIFEST_NAME) is not None

    foreign = tmp_path / "foreign"
    (foreign / "transformer").mkdir(parents=True)
    (foreign / "transformer" / "notes.txt").write_text("mine")
    refused = runner.invoke(app, ["fetch-weights", "--source", "shapes", "--only", "flux", "--flux-dir", str(foreign)])
    assert refused.exit_code == 1 and "without a manifest" in refused.stderr
    assert (foreign / "transformer" / "notes.txt").read_text() == "mine"
