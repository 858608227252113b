"""fetch_from_hub / plan_fetch against fake Hugging Face and ModelScope hubs on 127.0.0.1 (tests/fakehub.py).

Nothing here touches the network: HF_HOME, MODELSCOPE_CACHE and MODELSCOPE_HOME point at tmp dirs, tokens
from the environment are removed, and every request goes to a loopback server that records it.
"""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from fakehub import (
    CLIP_FILES,
    FLUX_DEV_FILES,
    HPS_FILES,
    FakeHub,
    FakeRepo,
    free_port_url,
    isolate_hub_environment,
    sha256_of,
    write_random_repo,
)

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.hub import FETCH_LOCK, FetchRequest, fetch_from_hub, hub_parts, plan_fetch
from fluxgrpo.weights.layout import check_flux_dir, check_hps_dir
from fluxgrpo.weights.manifest import read_manifest

FLUX_ID = "black-forest-labs/FLUX.1-dev"
HPS_ID = {"hf": "xswu/HPSv2", "modelscope": "AI-ModelScope/HPSv2"}
CLIP_ID = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_FALLBACK_ID = "AI-ModelScope/CLIP-ViT-H-14-laion2B-s32B-b79K"
FLUX_ROOT_FILES = {
    ".gitattributes",
    "README.md",
    "LICENSE.md",
    "dev_grid.jpg",
    "flux1-dev.safetensors",
    "ae.safetensors",
    "configuration.json",
}
FLUX_WANTED = sorted(p for p in FLUX_DEV_FILES if p not in FLUX_ROOT_FILES)
BIG_SHARD = "transformer/diffusion_pytorch_model-00001-of-00003.safetensors"  # 200,000 bytes
# The wanted FLUX files are every listed file but the 6 root extras:
# 536 + 300 + 613 + 3000 + 782 + 5000 + 4500 + 700 + 1200 + 588 + 705 + 1500 + 600 + 2000 + 2400 + 900
# + 500 + 200000 + 9000 + 3800 + 1200 + 774 + 1600 = 242,198 bytes in 23 files.
FLUX_WANTED_BYTES = 242_198
SOURCES = ("hf", "modelscope")

Repos = namedtuple("Repos", "flux hps clip")


@pytest.fixture(autouse=True)
def _isolated_hub_env(tmp_path, monkeypatch):
    from huggingface_hub import constants as hf_constants

    isolate_hub_environment(tmp_path, monkeypatch)
    # huggingface_hub writes whole chunks (10 MB), so a dropped connection loses the chunk in flight. Against
    # multi-GB shards that is a small loss; against these kB-sized files it would be everything. With 100-byte
    # chunks what arrived before a drop reaches the disk, as most of it does in real use.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 100)


def make_repos(
    tmp_path: Path,
    source: str,
    *,
    gated_flux: bool = False,
    tokens: frozenset[str] = frozenset(),
    clip_id: str = CLIP_ID,
    hps_files: dict[str, int] = HPS_FILES,
) -> Repos:
    flux_files = dict(FLUX_DEV_FILES)
    if source == "modelscope":
        flux_files["configuration.json"] = 120  # ModelScope's own addition at the repo root
    return Repos(
        FakeRepo(
            FLUX_ID,
            write_random_repo(tmp_path / "served" / "flux", flux_files, seed=1),
            gated=gated_flux,
            granted_tokens=tokens,
        ),
        FakeRepo(HPS_ID[source], write_random_repo(tmp_path / "served" / "hps", hps_files, seed=2)),
        FakeRepo(clip_id, write_random_repo(tmp_path / "served" / "clip", CLIP_FILES, seed=3)),
    )


def fetch(hub: FakeHub, tmp_path: Path, **kwargs):
    kwargs.setdefault("progress", False)
    return fetch_from_hub(
        FetchRequest(hub.flavour, flux_dir=tmp_path / "flux", hps_dir=tmp_path / "hps_ckpt", endpoint=hub.url, **kwargs)
    )


def requested(hub: FakeHub) -> list[str]:
    return [path for _, path, _ in hub.content_requests()]


# -- the whole fetch -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
def test_full_fetch_lands_in_the_standard_layout_and_checks_complete(tmp_path, source, capsys):
    repos = make_repos(tmp_path, source)
    with FakeHub(source, list(repos)) as hub:
        summary = fetch(hub, tmp_path, progress=source == "hf")

    flux_dir, hps_dir = tmp_path / "flux", tmp_path / "hps_ckpt"
    flux_status = check_flux_dir(flux_dir)
    assert flux_status.complete, flux_status.problems
    assert flux_status.source == source
    assert [s.complete for s in check_hps_dir(hps_dir)] == [True, True]

    # Byte-identical copies, and real files (no symlinks into a cache).
    for rel in FLUX_WANTED:
        assert (flux_dir / rel).read_bytes() == (repos.flux.root / rel).read_bytes()
        assert not (flux_dir / rel).is_symlink()
    assert (hps_dir / "HPS_v2.1_compressed.pt").read_bytes() == (repos.hps.root / "HPS_v2.1_compressed.pt").read_bytes()
    assert (hps_dir / "open_clip_pytorch_model.bin").read_bytes() == (
        repos.clip.root / "open_clip_pytorch_model.bin"
    ).read_bytes()

    manifest = read_manifest(flux_dir)
    assert manifest.source == source and manifest.repo == FLUX_ID
    assert manifest.revision == (repos.flux.sha if source == "hf" else "master")
    assert [f.path for f in manifest.files] == FLUX_WANTED
    assert {f.path: f.sha256 for f in manifest.files} == {p: sha256_of(repos.flux.root / p) for p in FLUX_WANTED}
    hps_manifest = read_manifest(hps_dir, "manifest.hps.json")
    assert (hps_manifest.repo, [f.path for f in hps_manifest.files]) == (HPS_ID[source], ["HPS_v2.1_compressed.pt"])
    assert read_manifest(hps_dir, "manifest.clip.json").files[0].sha256 == sha256_of(
        repos.clip.root / "open_clip_pytorch_model.bin"
    )

    # 23 FLUX files + the HPS checkpoint (2,100 B) + the open_clip weights (3,900 B).
    assert (summary.files, summary.files_downloaded) == (25, 25)
    assert summary.bytes_downloaded == FLUX_WANTED_BYTES + 2_100 + 3_900
    assert summary.bytes_present == 0
    assert summary.revisions["flux"] == manifest.revision
    if source == "hf":
        assert "flux: complete, 23 files verified" in capsys.readouterr().err


@pytest.mark.parametrize("source", SOURCES)
def test_only_the_allow_listed_files_are_ever_requested(tmp_path, source):
    with FakeHub(source, list(make_repos(tmp_path, source))) as hub:
        fetch(hub, tmp_path)
        touched = hub.content_requests(methods=("GET", "HEAD"))
    by_repo = {repo: {path for r, path, _ in touched if r == repo} for repo in (FLUX_ID, HPS_ID[source], CLIP_ID)}
    assert by_repo == {
        FLUX_ID: set(FLUX_WANTED),  # never flux1-dev.safetensors, ae.safetensors, dev_grid.jpg, README, LICENSE
        HPS_ID[source]: {"HPS_v2.1_compressed.pt"},
        CLIP_ID: {"open_clip_pytorch_model.bin"},
    }


@pytest.mark.parametrize("source", SOURCES)
def test_second_run_downloads_nothing_and_a_damaged_file_is_fetched_again(tmp_path, source):
    with FakeHub(source, list(make_repos(tmp_path, source))) as hub:
        fetch(hub, tmp_path)
        hub.reset_requests()
        again = fetch(hub, tmp_path)
        assert requested(hub) == []
        assert (again.files_downloaded, again.bytes_downloaded) == (0, 0)
        assert again.bytes_present == FLUX_WANTED_BYTES + 6_000
        assert check_flux_dir(tmp_path / "flux").complete

        # Same size, one byte changed, touched after the manifest: the hash check finds it.
        damaged = tmp_path / "flux" / "vae" / "diffusion_pytorch_model.safetensors"
        data = bytearray(damaged.read_bytes())
        data[10] ^= 0xFF
        damaged.write_bytes(bytes(data))
        hub.reset_requests()
        repaired = fetch(hub, tmp_path, parts=["flux"])
        assert requested(hub) == ["vae/diffusion_pytorch_model.safetensors"]
        assert repaired.files_downloaded == 1

        # Damage that keeps its old timestamp is trusted through the manifest until rehash=True reads it.
        stamp = damaged.stat()
        damaged.write_bytes(bytes(data))
        os.utime(damaged, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        hub.reset_requests()
        fetch(hub, tmp_path, parts=["flux"])
        assert requested(hub) == []
        fetch(hub, tmp_path, parts=["flux"], rehash=True)
        assert requested(hub) == ["vae/diffusion_pytorch_model.safetensors"]
    assert sha256_of(damaged) == read_manifest(tmp_path / "flux").files[-1].sha256


# -- interruptions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
def test_a_connection_dropped_mid_file_is_recovered_in_the_same_run(tmp_path, source):
    repos = make_repos(tmp_path, source)
    with FakeHub(source, list(repos)) as hub:
        hub.drop(FLUX_ID, BIG_SHARD)
        fetch(hub, tmp_path, parts=["flux"])
        shard_requests = [rng for _, path, rng in hub.content_requests() if path == BIG_SHARD]
    assert check_flux_dir(tmp_path / "flux").complete
    assert (tmp_path / "flux" / BIG_SHARD).read_bytes() == (repos.flux.root / BIG_SHARD).read_bytes()
    # The server sent 100,000 of 200,000 bytes before closing; the retry asks for the rest only.
    assert shard_requests == [None, "bytes=100000-"]


@pytest.mark.parametrize("source", SOURCES)
def test_an_interrupted_run_leaves_no_manifest_and_the_next_run_fetches_only_what_is_missing(tmp_path, source):
    repos = make_repos(tmp_path, source)
    flux_dir = tmp_path / "flux"
    victim = "vae/diffusion_pytorch_model.safetensors"  # 1,600 bytes
    with FakeHub(source, list(repos)) as hub:
        hub.drop(FLUX_ID, victim)
        hub.refuse(FLUX_ID, victim, times=-1)
        # One worker takes files largest first, so the larger files are finished when the victim fails.
        with pytest.raises(FluxgrpoError, match="403"):
            fetch(hub, tmp_path, parts=["flux"], max_workers=1)
        assert read_manifest(flux_dir) is None
        assert not check_flux_dir(flux_dir).complete
        finished = {p for p in FLUX_WANTED if (flux_dir / p).is_file()}
        assert BIG_SHARD in finished and victim not in finished
        partial = flux_dir / f"{victim}.incomplete"
        assert partial.stat().st_size == 800  # half of 1,600 bytes arrived before the drop
        resumable = plan_fetch(
            source, parts=["flux"], flux_dir=flux_dir, hps_dir=tmp_path / "hps_ckpt", endpoint=hub.url
        )
        assert [
            (f.path, f.state, f.resume_from, f.bytes_to_fetch) for f in resumable.parts[0].to_fetch if f.path == victim
        ] == [(victim, "resume", 800, 800)]

        hub.clear_faults()
        hub.reset_requests()
        summary = fetch(hub, tmp_path, parts=["flux"])
        second = hub.content_requests()
    assert sorted(path for _, path, _ in second) == sorted(set(FLUX_WANTED) - finished)
    assert check_flux_dir(flux_dir).complete
    assert summary.bytes_present == sum(FLUX_DEV_FILES[p] for p in finished)
    assert [rng for _, path, rng in second if path == victim] == ["bytes=800-"]
    assert not partial.exists()
    assert summary.bytes_downloaded == FLUX_WANTED_BYTES - summary.bytes_present - 800


@pytest.mark.parametrize("source", SOURCES)
def test_a_partial_file_left_by_a_killed_run_is_continued_from_where_it_stopped(tmp_path, source):
    """A kill leaves <file>.incomplete with the first bytes: the next run plans "resume" and asks for the rest."""
    repos = make_repos(tmp_path, source)
    flux_dir = tmp_path / "flux"
    served = (repos.flux.root / BIG_SHARD).read_bytes()
    partial = flux_dir / f"{BIG_SHARD}.incomplete"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(served[:50_000])
    with FakeHub(source, list(repos)) as hub:
        plan = plan_fetch(source, parts=["flux"], flux_dir=flux_dir, hps_dir=tmp_path / "hps_ckpt", endpoint=hub.url)
        shard = next(f for f in plan.parts[0].files if f.path == BIG_SHARD)
        assert (shard.state, shard.resume_from, shard.bytes_to_fetch) == ("resume", 50_000, 150_000)
        assert plan.bytes_to_fetch == FLUX_WANTED_BYTES - 50_000
        summary = fetch(hub, tmp_path, parts=["flux"])
        shard_requests = [rng for _, path, rng in hub.content_requests() if path == BIG_SHARD]
    assert shard_requests == ["bytes=50000-"]
    assert (flux_dir / BIG_SHARD).read_bytes() == served
    assert not partial.exists()
    assert check_flux_dir(flux_dir).complete
    assert summary.bytes_downloaded == FLUX_WANTED_BYTES - 50_000


@pytest.mark.parametrize("source", SOURCES)
def test_a_partial_file_with_wrong_bytes_is_downloaded_again_from_zero(tmp_path, source):
    repos = make_repos(tmp_path, source)
    flux_dir = tmp_path / "flux"
    partial = flux_dir / f"{BIG_SHARD}.incomplete"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 50_000)  # the right length for a prefix, the wrong bytes
    with FakeHub(source, list(repos)) as hub:
        summary = fetch(hub, tmp_path, parts=["flux"])
        shard_requests = [rng for _, path, rng in hub.content_requests() if path == BIG_SHARD]
    # Continued first (the digest can only be checked on the whole file), then once more from byte 0.
    assert shard_requests == ["bytes=50000-", None]
    assert (flux_dir / BIG_SHARD).read_bytes() == (repos.flux.root / BIG_SHARD).read_bytes()
    assert not partial.exists()
    assert check_flux_dir(flux_dir).complete
    # 150,000 bytes of the continued attempt + 200,000 of the second + the other files.
    assert summary.bytes_downloaded == FLUX_WANTED_BYTES + 150_000


def test_a_hugging_face_partial_longer_than_the_file_is_started_again(tmp_path):
    repos = make_repos(tmp_path, "hf")
    partial = tmp_path / "hps_ckpt" / "HPS_v2.1_compressed.pt.incomplete"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"x" * 2_500)  # the file has 2,100 bytes
    with FakeHub("hf", list(repos)) as hub:
        fetch(hub, tmp_path, parts=["hps"])
        assert [rng for _, _, rng in hub.content_requests()] == [None]
    assert sha256_of(tmp_path / "hps_ckpt" / "HPS_v2.1_compressed.pt") == sha256_of(
        repos.hps.root / "HPS_v2.1_compressed.pt"
    )
    assert not partial.exists()


def test_a_hugging_face_download_refused_before_any_byte_leaves_no_partial_file(tmp_path):
    with FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub:
        hub.refuse(HPS_ID["hf"], "HPS_v2.1_compressed.pt", times=-1)
        with pytest.raises(FluxgrpoError, match="HTTP 403"):
            fetch(hub, tmp_path, parts=["hps"])
    assert [p.name for p in (tmp_path / "hps_ckpt").iterdir()] == [".cache"]  # only the fetch lock's folder


def test_a_resumed_hugging_face_download_reports_the_whole_file_as_progress(tmp_path):
    """The per-file bar spans the whole file: the bytes already on disk are reported first, then the rest."""
    from fluxgrpo.weights.hub_clients import HuggingFaceClient, RemoteFile

    repos = make_repos(tmp_path, "hf")
    served = (repos.hps.root / "HPS_v2.1_compressed.pt").read_bytes()
    root = tmp_path / "hps_ckpt"
    root.mkdir()
    (root / "HPS_v2.1_compressed.pt.incomplete").write_bytes(served[:700])
    reported: list[int] = []
    with FakeHub("hf", list(repos)) as hub:
        client = HuggingFaceClient(token=None, endpoint=hub.url)
        assert client.partial_bytes(root, "HPS_v2.1_compressed.pt") == 700
        client.download(
            HPS_ID["hf"], repos.hps.sha, RemoteFile("HPS_v2.1_compressed.pt", len(served)), root, reported.append
        )
    assert reported[0] == 700
    assert sum(reported) == 2_100  # 700 already on disk + 1,400 received
    assert (root / "HPS_v2.1_compressed.pt").read_bytes() == served
    assert client.partial_bytes(root, "HPS_v2.1_compressed.pt") == 0


def test_orphaned_hugging_face_partial_files_are_removed(tmp_path):
    orphan = tmp_path / "hps_ckpt" / ".cache" / "huggingface" / "download" / "abc123.deadbeef.1234abcd.incomplete"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x" * 1000)
    with FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub:
        fetch(hub, tmp_path, parts=["hps"])
    assert not orphan.exists()


# -- verification ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
def test_a_corrupted_download_is_fetched_once_more(tmp_path, source):
    repos = make_repos(tmp_path, source)
    with FakeHub(source, list(repos)) as hub:
        hub.corrupt(HPS_ID[source], "HPS_v2.1_compressed.pt", times=1)
        fetch(hub, tmp_path, parts=["hps"])
        assert requested(hub) == ["HPS_v2.1_compressed.pt"] * 2
    assert sha256_of(tmp_path / "hps_ckpt" / "HPS_v2.1_compressed.pt") == sha256_of(
        repos.hps.root / "HPS_v2.1_compressed.pt"
    )
    assert check_hps_dir(tmp_path / "hps_ckpt")[0].complete


@pytest.mark.parametrize("source", SOURCES)
def test_a_file_corrupted_twice_is_an_error_and_is_not_left_behind(tmp_path, source):
    repos = make_repos(tmp_path, source)
    with FakeHub(source, list(repos)) as hub:
        hub.corrupt(HPS_ID[source], "HPS_v2.1_compressed.pt", times=-1)
        with pytest.raises(FluxgrpoError, match=r"HPS_v2\.1_compressed\.pt .* failed its sha256 check twice") as err:
            fetch(hub, tmp_path, parts=["hps"])
        assert requested(hub) == ["HPS_v2.1_compressed.pt"] * 2
    assert sha256_of(repos.hps.root / "HPS_v2.1_compressed.pt") in str(err.value)
    assert not (tmp_path / "hps_ckpt" / "HPS_v2.1_compressed.pt").exists()
    assert read_manifest(tmp_path / "hps_ckpt", "manifest.hps.json") is None


def test_small_hugging_face_files_are_checked_by_their_git_blob_id(tmp_path):
    """model_index.json is a git file on HF: the listing gives its git blob id, not a sha256."""
    with FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub:
        hub.corrupt(FLUX_ID, "model_index.json", times=1)
        fetch(hub, tmp_path, parts=["flux"])
        assert requested(hub).count("model_index.json") == 2
    assert check_flux_dir(tmp_path / "flux").complete


# -- errors ------------------------------------------------------------------------------------------------------


def test_gated_flux_without_a_token_names_the_licence_page(tmp_path):
    with FakeHub("hf", list(make_repos(tmp_path, "hf", gated_flux=True))) as hub:
        with pytest.raises(FluxgrpoError) as err:
            fetch(hub, tmp_path, parts=["flux"])
        assert requested(hub) == []
    assert (
        "accept the licence at https://huggingface.co/black-forest-labs/FLUX.1-dev and run `hf auth login` or "
        "pass --token" in str(err.value)
    )
    assert "401" in str(err.value)
    assert not (tmp_path / "flux").exists()  # refused before anything was written


def test_gated_flux_with_a_token_lacking_the_grant_says_403_and_never_shows_the_token(tmp_path, capsys):
    secret = "hf_not_granted_0123456789"
    with FakeHub("hf", list(make_repos(tmp_path, "hf", gated_flux=True, tokens=frozenset({"hf_granted"})))) as hub:
        with pytest.raises(FluxgrpoError, match="403") as err:
            fetch(hub, tmp_path, parts=["flux"], token=secret, progress=True)
        assert "https://huggingface.co/black-forest-labs/FLUX.1-dev" in str(err.value)
        assert secret not in str(err.value) + capsys.readouterr().err

        fetch(hub, tmp_path, parts=["flux"], token="hf_granted")
        assert all(r.authorized for r in hub.requests if "/resolve/" in r.path)
    assert check_flux_dir(tmp_path / "flux").complete


@pytest.mark.parametrize("source", SOURCES)
def test_an_unknown_repo_is_a_clear_404(tmp_path, source):
    repos = make_repos(tmp_path, source)
    with (
        FakeHub(source, [repos.flux, repos.clip]) as hub,
        pytest.raises(FluxgrpoError, match=f"repository {HPS_ID[source]} .*not found on {hub.url}"),
    ):
        fetch(hub, tmp_path, parts=["hps"])


@pytest.mark.parametrize("source", SOURCES)
def test_an_unknown_revision_names_the_flag(tmp_path, source):
    with (
        FakeHub(source, list(make_repos(tmp_path, source))) as hub,
        pytest.raises(FluxgrpoError, match=r"revision 'v9-nope' .*--revision"),
    ):
        fetch(hub, tmp_path, parts=["flux"], revision="v9-nope")


def test_a_pinned_commit_is_fetched_and_recorded(tmp_path):
    repos = make_repos(tmp_path, "hf")
    with FakeHub("hf", list(repos)) as hub:
        summary = fetch(hub, tmp_path, parts=["flux"], revision=repos.flux.sha)
    assert summary.revisions == {"flux": repos.flux.sha}
    assert read_manifest(tmp_path / "flux").revision == repos.flux.sha


@pytest.mark.parametrize("source", SOURCES)
def test_a_repo_without_the_wanted_file_says_which(tmp_path, source):
    hps_files = {k: v for k, v in HPS_FILES.items() if k != "HPS_v2.1_compressed.pt"}
    with (
        FakeHub(source, list(make_repos(tmp_path, source, hps_files=hps_files))) as hub,
        pytest.raises(FluxgrpoError, match=r"has no file matching HPS_v2\.1_compressed\.pt"),
    ):
        fetch(hub, tmp_path, parts=["hps"])


def test_modelscope_falls_back_to_the_ai_modelscope_clip_copy(tmp_path):
    with FakeHub("modelscope", list(make_repos(tmp_path, "modelscope", clip_id=CLIP_FALLBACK_ID))) as hub:
        fetch(hub, tmp_path, parts=["clip"])
    assert read_manifest(tmp_path / "hps_ckpt", "manifest.clip.json").repo == CLIP_FALLBACK_ID
    assert check_hps_dir(tmp_path / "hps_ckpt")[1].complete


def test_an_unreachable_endpoint_is_named(tmp_path):
    url = free_port_url()
    with pytest.raises(FluxgrpoError, match=f"cannot reach {url}"):
        fetch_from_hub(FetchRequest("hf", parts=["hps"], hps_dir=tmp_path / "hps_ckpt", endpoint=url, progress=False))


def test_another_fetch_into_the_same_folder_is_refused(tmp_path):
    from filelock import FileLock

    lock = tmp_path / "hps_ckpt" / FETCH_LOCK
    lock.parent.mkdir(parents=True)
    with (
        FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub,
        FileLock(str(lock)),
        pytest.raises(FluxgrpoError, match="another fetch-weights is already writing"),
    ):
        fetch(hub, tmp_path, parts=["hps"])


def test_bad_arguments_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--only"):
        fetch_from_hub(FetchRequest("hf", parts=["flux", "nope"], flux_dir=tmp_path, hps_dir=tmp_path))
    with pytest.raises(UsageError, match="--only flux --revision"):
        fetch_from_hub(FetchRequest("hf", parts=["flux", "hps"], revision="main", flux_dir=tmp_path, hps_dir=tmp_path))
    with pytest.raises(UsageError, match="--source"):
        fetch_from_hub(FetchRequest("civitai", parts=["flux"], flux_dir=tmp_path, hps_dir=tmp_path))


# -- planning and disk space -----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
def test_dry_run_lists_files_and_total_and_downloads_nothing(tmp_path, source):
    with FakeHub(source, list(make_repos(tmp_path, source))) as hub:
        summary = fetch(hub, tmp_path, dry_run=True)
        assert requested(hub) == []
    assert not (tmp_path / "flux").exists() and not (tmp_path / "hps_ckpt").exists()
    plan = summary.plan
    flux_plan = plan.parts[0]
    assert [(f.path, f.size, f.state) for f in flux_plan.files] == [
        (p, FLUX_DEV_FILES[p], "download") for p in FLUX_WANTED
    ]
    assert plan.bytes_to_fetch == plan.bytes_total == FLUX_WANTED_BYTES + 6_000
    assert plan.files_to_fetch == 25
    assert summary.dry_run and summary.files_downloaded == 0 and summary.bytes_downloaded == 0
    assert summary.to_dict()["plan"]["bytes_to_fetch"] == FLUX_WANTED_BYTES + 6_000


def test_plan_after_a_partial_loss_lists_only_the_missing_file(tmp_path):
    with FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub:
        fetch(hub, tmp_path)
        (tmp_path / "flux" / BIG_SHARD).unlink()
        plan = plan_fetch(
            "hf",
            parts=["flux", "hps", "clip"],
            flux_dir=tmp_path / "flux",
            hps_dir=tmp_path / "hps_ckpt",
            endpoint=hub.url,
        )
    to_fetch = [(f.path, f.size) for part in plan.parts for f in part.to_fetch]
    assert to_fetch == [(BIG_SHARD, 200_000)]
    assert plan.bytes_to_fetch == 200_000


def test_not_enough_disk_space_is_refused_before_any_download(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    # hps + clip both go to hps_ckpt: 2,100 + 3,900 = 6,000 bytes needed; one byte short.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 5_999, 5_999))
    with FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub:
        with pytest.raises(FluxgrpoError) as err:
            fetch(hub, tmp_path, parts=["hps", "clip"])
        assert requested(hub) == []
    message = str(err.value)
    assert "not enough free disk space in" in message and str(tmp_path / "hps_ckpt") in message
    assert "6.00 kB (6000 bytes) to download but 6.00 kB (5999 bytes) free" in message
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 6_000, 6_000))
    with FakeHub("hf", list(make_repos(tmp_path, "hf"))) as hub:
        fetch(hub, tmp_path, parts=["hps", "clip"])
    assert all(s.complete for s in check_hps_dir(tmp_path / "hps_ckpt"))


def test_the_flux_allow_list_keeps_the_diffusers_folders_and_nothing_else():
    from fnmatch import fnmatchcase

    allow = hub_parts()["flux"].allow
    kept = sorted(p for p in [*FLUX_DEV_FILES, "configuration.json"] if any(fnmatchcase(p, a) for a in allow))
    assert kept == FLUX_WANTED
    for part in hub_parts().values():
        assert set(part.repos) == {"hf", "modelscope"}, part.name


# -- real (tiny) weights through the fake hub ------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_weights_served_by_the_fake_hub_load_with_diffusers(tmp_path, tiny_weights):
    """write_tiny_weights' folders, served as the three HF repos, are fetched and FluxPipeline loads the result."""
    import torch
    from diffusers import FluxPipeline

    torch.set_num_threads(1)
    served_flux, served_reward = tmp_path / "served" / "flux", tiny_weights.hps_dir  # the shared folder is read-only
    shutil.copytree(tiny_weights.flux_dir, served_flux)
    (served_flux / "flux1-dev.safetensors").write_bytes(b"never requested")  # a root single-file checkpoint
    repos = [FakeRepo(FLUX_ID, served_flux), FakeRepo(HPS_ID["hf"], served_reward), FakeRepo(CLIP_ID, served_reward)]
    with FakeHub("hf", repos) as hub:
        summary = fetch(hub, tmp_path)
        assert "flux1-dev.safetensors" not in requested(hub)
        assert "manifest.json" not in requested(hub)  # the served folder's own manifest is not a repo file we want
    flux_dir = tmp_path / "flux"
    assert check_flux_dir(flux_dir).complete and all(s.complete for s in check_hps_dir(tmp_path / "hps_ckpt"))
    flux_files = len([p for p in served_flux.rglob("*") if p.is_file()]) - 2  # not manifest.json, flux1-dev
    assert summary.files == flux_files + 2  # and the HPS checkpoint and the open_clip weights

    original, loaded = FluxPipeline.from_pretrained(served_flux), FluxPipeline.from_pretrained(flux_dir)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        want, got = getattr(original, name).state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys(), name
        assert all(torch.equal(want[k], got[k]) for k in want), name
    prompt = "a red fox in the snow"
    assert loaded.tokenizer_2(prompt).input_ids == original.tokenizer_2(prompt).input_ids
