"""``fluxgrpo score``: HPSv2 against open_clip computed by hand, pairing, --compare arithmetic, CSV, errors."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.rewards.scoring import ScoredImage, mean_std
from fluxgrpo.score import ScoreRequest, compare_runs, natural_key, score

runner = CliRunner()
# OpenAI CLIP's pixel statistics, as hpsv2 normalises with them (written out here, not imported from fluxgrpo).
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def gray_png(path: Path, level: int, size: tuple[int, int] = (8, 8)) -> Path:
    """A solid gray image: its brightness score is level / 255."""
    Image.new("RGB", size, (level, level, level)).save(path)
    return path


def hand_made_index(folder: Path, prompts: list[str], levels: list[list[int]], seeds: list[list[int]]) -> Path:
    """A sample index written by hand: image j of prompt i is a solid gray of levels[i][j] with seed seeds[i][j]."""
    folder.mkdir(parents=True)
    images = []
    for i, prompt in enumerate(prompts):
        for j, level in enumerate(levels[i]):
            name = f"{i:04d}_{j:02d}.png"
            gray_png(folder / name, level)
            images.append({"file": name, "prompt": prompt, "prompt_index": i, "image_index": j, "seed": seeds[i][j]})
    document = {
        "format": "fluxgrpo-sample-index",
        "format_version": 1,
        "fluxgrpo_version": "test",
        "model": "m",
        "checkpoint": None,
        "ema": False,
        "settings": {},
        "prompts": prompts,
        "grid": "grid.png",
        "images": images,
    }
    (folder / "index.json").write_text(json.dumps(document))
    return folder / "index.json"


# --- HPSv2 equals open_clip computed directly ---------------------------------------------------------------------


def test_hps_score_equals_open_clip_computed_directly(tiny_weights, tmp_path):
    import open_clip
    import torchvision.transforms.v2.functional as TF

    # A fixed, non-square, non-constant image (so the resize and the padding both matter).
    rows, cols = np.mgrid[0:60, 0:90]
    array = np.stack([(rows * 4) % 256, (cols * 3) % 256, ((rows + cols) * 2) % 256], axis=-1).astype(np.uint8)
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(array).save(folder / "fixed.png")
    prompt = "a red cat on a blue chair"
    (tmp_path / "prompts.txt").write_text(prompt + "\n")

    report = score(
        ScoreRequest(
            images_dir=str(folder),
            prompts_file=str(tmp_path / "prompts.txt"),
            hps_dir=str(tiny_weights.hps_dir),
            device="cpu",
        )
    )

    # The model built by hand from the tiny checkpoint: its open_clip config registered under a name of our own.
    config = json.loads((tiny_weights.hps_dir / "open_clip_config.json").read_text())
    config_path = tmp_path / "test-score-tiny-hps.json"
    config_path.write_text(json.dumps(config.get("model_cfg", config)))
    open_clip.add_model_config(config_path)
    model = open_clip.create_model("test-score-tiny-hps", pretrained=None, precision="fp32", device="cpu").eval()
    state = torch.load(tiny_weights.hps_dir / "HPS_v2.1_compressed.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["state_dict"])
    tokenizer = open_clip.get_tokenizer("test-score-tiny-hps")
    # hpsv2's validation transform: longest side to 224 (bicubic, antialiased): 60 x 90 → 149 x 224 (60 · 224/90
    # = 149.3), zero padding centred to 224 x 224 (75 rows: 37 above, 38 below), CLIP normalisation.
    pixels = TF.to_dtype(TF.to_image(Image.open(folder / "fixed.png").convert("RGB")), torch.float32, scale=True)
    pixels = TF.resize(pixels, [149, 224], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    pixels = TF.pad(pixels, [0, 37, 0, 38], fill=0.0)
    pixels = TF.normalize(pixels, MEAN, STD).unsqueeze(0)
    assert pixels.shape == (1, 3, 224, 224)
    with torch.no_grad():
        image_features = model.encode_image(pixels, normalize=True)
        text_features = model.encode_text(tokenizer([prompt]), normalize=True)
    expected = (image_features @ text_features.T).item()

    assert report.images[0].score == pytest.approx(expected, abs=1e-6)
    assert report.overall.count == 1 and report.overall.std == 0.0


# --- arithmetic -----------------------------------------------------------------------------------------------------


def test_mean_std_is_the_population_std():
    # 0.2, 0.4, 0.6, 0.6: mean 0.45; deviations -0.25, -0.05, 0.15, 0.15; squares sum 0.11; / 4 = 0.0275
    mean, std = mean_std([0.2, 0.4, 0.6, 0.6])
    assert mean == pytest.approx(0.45) and std == pytest.approx(math.sqrt(0.0275))
    assert mean_std([0.3]) == (0.3, 0.0)


def _scored(values: dict[tuple[int, int], float], prompts=("p0", "p1")) -> list[ScoredImage]:
    return [ScoredImage(f"{i}_{j}.png", prompts[i], i, j, 100 * i + j, v) for (i, j), v in values.items()]


def test_compare_runs_pure_arithmetic():
    # this:  p0 = 0.5, 0.7 (mean 0.6); p1 = 0.1, 0.3 (mean 0.2); p2 = 0.4 (mean 0.4)
    # other: p0 = 0.4, 0.4 (mean 0.4); p1 = 0.2, 0.2 (mean 0.2); p2 = 0.5 (mean 0.5)
    # differences: p0 +0.2 (improved), p1 0.0 (not improved: equal), p2 -0.1 → 1 of 3 improved
    # overall: this (0.5+0.7+0.1+0.3+0.4)/5 = 0.4; other (0.4+0.4+0.2+0.2+0.5)/5 = 0.34; difference 0.06
    prompts = ("p0", "p1", "p2")
    this = _scored({(0, 0): 0.5, (0, 1): 0.7, (1, 0): 0.1, (1, 1): 0.3, (2, 0): 0.4}, prompts)
    other = _scored({(2, 0): 0.5, (1, 1): 0.2, (0, 0): 0.4, (1, 0): 0.2, (0, 1): 0.4}, prompts)  # any order
    result = compare_runs(this, other, "other.json")
    assert [(p.prompt_index, p.count) for p in result.prompts] == [(0, 2), (1, 2), (2, 1)]
    assert [p.difference for p in result.prompts] == pytest.approx([0.2, 0.0, -0.1])
    assert (result.mean, result.other_mean, result.mean_difference) == pytest.approx((0.4, 0.34, 0.06))
    assert (result.improved_prompts, result.prompt_count, result.improved_fraction) == (1, 3, pytest.approx(1 / 3))


def test_compare_refuses_runs_that_do_not_pair():
    this = _scored({(0, 0): 0.5, (1, 0): 0.1})
    with pytest.raises(FluxgrpoError, match=r"prompt 1 image 0 is in this run but not in b\.json"):
        compare_runs(this, _scored({(0, 0): 0.5}), "b.json")
    with pytest.raises(FluxgrpoError, match=r"prompt 0 image 1 is in b\.json but not in this run"):
        compare_runs(this, _scored({(0, 0): 0.5, (1, 0): 0.1, (0, 1): 0.2}), "b.json")
    with pytest.raises(FluxgrpoError, match=r"prompt 1 differs: 'p1' in this run but 'other' in b\.json"):
        compare_runs(this, _scored({(0, 0): 0.5, (1, 0): 0.1}, prompts=("p0", "other")), "b.json")
    reseeded = [ScoredImage(o.file, o.prompt, o.prompt_index, o.image_index, 7, o.score) for o in this]
    with pytest.raises(FluxgrpoError, match=r"prompt 0 image 0 has seed 0 in this run but 7 in b\.json.*--seed"):
        compare_runs(this, reseeded, "b.json")


def test_cli_compare_on_hand_made_indexes(tmp_path):
    # Solid grays scored by brightness (level / 255): 51 → 0.2, 102 → 0.4, 153 → 0.6, 204 → 0.8.
    #   this:  p0 = 0.2, 0.4 (mean 0.3, std 0.1); p1 = 0.6, 0.6 (mean 0.6, std 0)
    #   other: p0 = 0.2, 0.2 (mean 0.2);          p1 = 0.8, 0.8 (mean 0.8)
    #   per prompt this − other: p0 +0.1 (improved), p1 -0.2 → improved fraction 1/2
    #   overall this 1.8 / 4 = 0.45 (std sqrt(0.0275), see test_mean_std_is_the_population_std); other 2.0 / 4 = 0.5
    #   mean difference 0.45 - 0.5 = -0.05
    prompts, seeds = ["p0", "p1"], [[11, 12], [21, 22]]
    this = hand_made_index(tmp_path / "this", prompts, [[51, 102], [153, 153]], seeds)
    other = hand_made_index(tmp_path / "other", prompts, [[51, 51], [204, 204]], seeds)
    csv_path = tmp_path / "scores.csv"
    result = runner.invoke(
        app,
        [
            "score",
            "--index",
            str(this),
            "--compare",
            str(other),
            "--reward",
            "brightness",
            "--device",
            "cpu",
            "--json",
            "--out",
            str(csv_path),
            "--batch-size",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert list(document) == ["reward", "source", "overall", "details", "prompts", "images", "compare"]
    # image spread (RMS distance from the mean image): other 51, 51, 204, 204 → 76.5 each; this 51, 102, 153, 153
    # (mean 114.75) → sqrt((63.75² + 12.75² + 2·38.25²) / 4) = 42.29, above half of 76.5: no warning
    collapse = document["compare"]["collapse"]
    assert collapse["other_image_spread"] == pytest.approx(76.5, abs=1e-6)
    assert collapse["image_spread"] == pytest.approx(42.2868, abs=1e-3) and collapse["warning"] is None
    assert document["overall"]["count"] == 4
    assert document["overall"]["mean"] == pytest.approx(0.45, abs=1e-6)
    assert document["overall"]["std"] == pytest.approx(math.sqrt(0.0275), abs=1e-6)
    assert [(p["mean"], p["std"], p["count"]) for p in document["prompts"]] == [
        (pytest.approx(0.3, abs=1e-6), pytest.approx(0.1, abs=1e-6), 2),
        (pytest.approx(0.6, abs=1e-6), 0.0, 2),
    ]
    compare = document["compare"]
    assert [p["difference"] for p in compare["prompts"]] == [
        pytest.approx(0.1, abs=1e-6),
        pytest.approx(-0.2, abs=1e-6),
    ]
    assert compare["mean"] == pytest.approx(0.45, abs=1e-6) and compare["other_mean"] == pytest.approx(0.5, abs=1e-6)
    assert compare["mean_difference"] == pytest.approx(-0.05, abs=1e-6)
    assert (compare["improved_prompts"], compare["prompt_count"], compare["improved_fraction"]) == (1, 2, 0.5)

    rows = list(csv.DictReader(csv_path.open()))
    assert [r["file"] for r in rows] == ["0000_00.png", "0000_01.png", "0001_00.png", "0001_01.png"]
    assert [r["seed"] for r in rows] == ["11", "12", "21", "22"]
    assert [float(r["difference"]) for r in rows] == [pytest.approx(d, abs=1e-6) for d in (0.0, 0.2, -0.2, -0.2)]

    table = runner.invoke(
        app, ["score", "--index", str(this), "--compare", str(other), "--reward", "brightness", "--device", "cpu"]
    )
    assert table.exit_code == 0, table.output
    assert "mean difference (this − other): -0.05000" in table.stdout
    assert "improved prompts: 1 of 2 (50%)" in table.stdout
    assert "0.30000 ± 0.10000" in table.stdout


# --- inputs and errors ----------------------------------------------------------------------------------------------


def test_images_pair_with_prompt_lines_in_name_order(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    # name order with digits as numbers: img1, img2, img10 (plain string order would put img10 second)
    gray_png(folder / "img10.png", 204)
    gray_png(folder / "img2.png", 102)
    gray_png(folder / "img1.png", 51)
    gray_png(folder / "grid.png", 255)  # sample's contact sheet: skipped
    (folder / "notes.txt").write_text("not an image")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\na cat\n\n")  # blank lines at the end ignored, the repeated "a cat" kept
    report = score(ScoreRequest(images_dir=str(folder), prompts_file=str(prompts), reward="brightness", device="cpu"))
    assert [(i.file, i.prompt, i.prompt_index, i.image_index) for i in report.images] == [
        ("img1.png", "a cat", 0, 0),
        ("img10.png", "a cat", 0, 1),
        ("img2.png", "a dog", 1, 0),
    ]
    by_file = {i.file: i.score for i in report.images}
    assert by_file == {"img1.png": pytest.approx(0.2), "img2.png": pytest.approx(0.4), "img10.png": pytest.approx(0.8)}
    # "a cat" = img1 (0.2) and img10 (0.8): mean 0.5, std 0.3
    assert (report.prompts[0].mean, report.prompts[0].std) == (pytest.approx(0.5), pytest.approx(0.3))
    assert sorted(["img10", "img2", "img1"], key=natural_key) == ["img1", "img2", "img10"]

    prompts.write_text("a cat\na dog\n")
    result = runner.invoke(
        app, ["score", "--images", str(folder), "--prompts", str(prompts), "--reward", "brightness", "--device", "cpu"]
    )
    assert result.exit_code == 1
    assert "3 images in" in result.stderr and "but 2 prompt lines in" in result.stderr


def test_errors_name_the_file_and_write_nothing(tmp_path):
    seeds = [[1]]
    index = hand_made_index(tmp_path / "run", ["p0"], [[51]], seeds)
    csv_path = tmp_path / "scores.csv"
    common = ["--reward", "brightness", "--device", "cpu", "--out", str(csv_path)]

    (tmp_path / "run" / "0000_00.png").write_bytes(b"this is no png")
    unreadable = runner.invoke(app, ["score", "--index", str(index), *common])
    assert unreadable.exit_code == 1 and "0000_00.png" in unreadable.stderr and "cannot read image" in unreadable.stderr

    gray_png(tmp_path / "run" / "0000_00.png", 51)
    (tmp_path / "run" / "0000_00.png").rename(tmp_path / "elsewhere.png")
    moved = runner.invoke(app, ["score", "--index", str(index), *common])
    assert moved.exit_code == 1 and "lists 0000_00.png, which is not in" in moved.stderr

    (tmp_path / "elsewhere.png").rename(tmp_path / "run" / "0000_00.png")
    document = json.loads(index.read_text())
    document["images"][0]["prompt_index"] = 3
    index.write_text(json.dumps(document))
    no_prompt = runner.invoke(app, ["score", "--index", str(index), *common])
    assert no_prompt.exit_code == 1 and "0000_00.png has no prompt" in no_prompt.stderr

    foreign = tmp_path / "videos2caption.json"
    foreign.write_text(json.dumps([{"caption": "p0", "prompt_embed_path": "0.pt"}]))
    not_ours = runner.invoke(app, ["score", "--index", str(foreign), *common])
    assert not_ours.exit_code == 1 and "videos2caption.json is not a fluxgrpo sample index" in not_ours.stderr

    other = hand_made_index(tmp_path / "other", ["p0"], [[51]], [[2]])
    fresh = hand_made_index(tmp_path / "fresh", ["p0"], [[51]], seeds)
    mismatch = runner.invoke(app, ["score", "--index", str(fresh), "--compare", str(other), *common])
    assert mismatch.exit_code == 1 and "has seed 1 in" in mismatch.stderr and "but 2 in" in mismatch.stderr
    assert not csv_path.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_usage_errors_exit_2(tmp_path):
    index = hand_made_index(tmp_path / "run", ["p0"], [[51]], [[1]])
    assert runner.invoke(app, ["score"]).exit_code == 2
    assert runner.invoke(app, ["score", "--images", str(tmp_path)]).exit_code == 2  # no --prompts
    assert (
        runner.invoke(app, ["score", "--index", str(index), "--images", str(tmp_path), "--prompts", "p"]).exit_code == 2
    )
    assert (
        runner.invoke(app, ["score", "--images", str(tmp_path), "--prompts", "p", "--compare", str(index)]).exit_code
        == 2
    )
    assert runner.invoke(app, ["score", "--index", str(index), "--reward", "nope", "--device", "cpu"]).exit_code == 2
    assert runner.invoke(app, ["score", "--index", str(index), "--batch-size", "0"]).exit_code == 2
    with pytest.raises(UsageError, match="--compare needs --index"):
        ScoreRequest(images_dir="d", prompts_file="p", compare="x").validate()


def test_sample_then_score_hpsv2_by_index_equals_by_folder(tiny_weights, tmp_path):
    from fluxgrpo.sample import build_request, sample
    from fluxgrpo.sampling.request import SampleSettings

    settings = SampleSettings(height=32, width=48, steps=2, max_sequence_length=16, images_per_prompt=2)
    request = build_request(
        model=str(tiny_weights.flux_dir),
        prompts=["a red cat", "a blue dog"],
        out_dir=tmp_path / "run",
        checkpoint=None,
        ema=False,
        settings=settings,
        device="cpu",
    )
    sample(request, show_progress=False)
    by_index = score(
        ScoreRequest(
            index=str(tmp_path / "run" / "index.json"), hps_dir=str(tiny_weights.hps_dir), device="cpu", batch_size=3
        )
    )
    lines = tmp_path / "lines.txt"
    lines.write_text("a red cat\na red cat\na blue dog\na blue dog\n")  # 0000_00, 0000_01, 0001_00, 0001_01
    by_folder = score(
        ScoreRequest(
            images_dir=str(tmp_path / "run"),
            prompts_file=str(lines),
            hps_dir=str(tiny_weights.hps_dir),
            device="cpu",
            batch_size=1,
        )
    )
    assert [i.file for i in by_index.images] == [i.file for i in by_folder.images]
    assert [i.score for i in by_index.images] == pytest.approx([i.score for i in by_folder.images], abs=1e-6)
    assert len({round(i.score, 6) for i in by_index.images}) > 1  # scores depend on the image and prompt
    assert by_index.images[0].seed is not None and by_folder.images[0].seed is None


# --- several rewards ------------------------------------------------------------------------------------------------


def _compared_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two hand-made runs (see test_cli_compare_on_hand_made_indexes for their brightness arithmetic)."""
    prompts, seeds = ["p0", "p1"], [[11, 12], [21, 22]]
    this = hand_made_index(tmp_path / "this", prompts, [[51, 102], [153, 153]], seeds)
    other = hand_made_index(tmp_path / "other", prompts, [[51, 51], [204, 204]], seeds)
    return this, other


def test_several_rewards_equal_each_reward_alone_bit_for_bit(tiny_weights, tmp_path):
    this, other = _compared_runs(tmp_path)
    names = ["brightness", "hpsv2", "clipscore"]
    common = ["score", "--index", str(this), "--compare", str(other), "--hps-dir", str(tiny_weights.hps_dir)]
    common += ["--device", "cpu", "--batch-size", "3"]

    def run(reward: str, csv_path: Path) -> dict:
        result = runner.invoke(app, [*common, "--reward", reward, "--json", "--out", str(csv_path)])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    alone = [run(name, tmp_path / f"{name}.csv") for name in names]
    together = run(",".join(names), tmp_path / "all.csv")
    # JSON floats round-trip exactly, so == is bitwise equality of every score, mean, std and difference.
    assert together == {"rewards": alone}
    assert [document["reward"] for document in together["rewards"]] == names
    assert len({document["overall"]["mean"] for document in alone}) == 3  # three different rewards really ran

    rows = list(csv.DictReader((tmp_path / "all.csv").open()))
    assert list(rows[0]) == [
        "file",
        "prompt_index",
        "image_index",
        "seed",
        "prompt",
        *(f"score_{name}" for name in names),
        "other_file",
        *(f"other_score_{name}" for name in names),
        *(f"difference_{name}" for name in names),
    ]
    for name in names:
        single = list(csv.DictReader((tmp_path / f"{name}.csv").open()))
        assert [row["file"] for row in rows] == [row["file"] for row in single]
        assert [row["seed"] for row in rows] == [row["seed"] for row in single]
        assert [row[f"score_{name}"] for row in rows] == [row["score"] for row in single]  # repr: every bit
        assert [row[f"other_score_{name}"] for row in rows] == [row["other_score"] for row in single]
        assert [row[f"difference_{name}"] for row in rows] == [row["difference"] for row in single]

    # The tables: a column per reward, mean ± std per prompt and overall, this / other / Δ per reward.
    table = runner.invoke(app, [*common, "--reward", ",".join(names)], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    assert "scoring with hpsv2 (2 of 3)" in table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "brightness" in line)
    assert header.index("brightness") < header.index("hpsv2") < header.index("clipscore")
    overall_row = next(i for i, line in enumerate(lines) if "overall" in line and "paired" not in line)
    assert "0.45000" in lines[overall_row] and "± 0.16583" in lines[overall_row + 1]  # sqrt(0.0275) = 0.16583
    assert "0.30000" in table.stdout and "± 0.10000" in table.stdout
    paired_row = next(i for i, line in enumerate(lines) if "overall (4 paired images)" in line)
    assert "0.45000" in lines[paired_row] and "0.50000" in lines[paired_row + 1] and "-0.05000" in lines[paired_row + 2]
    assert "prompts improved" in table.stdout and "1 of 2" in table.stdout


def test_one_reward_model_in_memory_at_a_time_after_every_input_is_checked(tiny_weights, tmp_path, monkeypatch):
    import weakref

    import fluxgrpo.score as score_module
    from fluxgrpo.score import score_rewards

    this, other = _compared_runs(tmp_path)
    events: list[str] = []
    loaded: list[weakref.ref] = []
    real_load, real_check = score_module.load_scorer, score_module.check_images_readable

    def load_scorer(name, hps_dir, device):
        import gc

        gc.collect()  # only what is still referenced survives
        events.append(f"load {name} ({sum(ref() is not None for ref in loaded)} loaded)")
        scorer = real_load(name, hps_dir, device)
        loaded.append(weakref.ref(scorer))
        return scorer

    def check_images_readable(items):
        events.append(f"check {len(list(items))} images")
        real_check(items)

    monkeypatch.setattr(score_module, "load_scorer", load_scorer)
    monkeypatch.setattr(score_module, "check_images_readable", check_images_readable)
    request = ScoreRequest(
        index=str(this),
        compare=str(other),
        reward="hpsv2,clipscore,brightness",
        hps_dir=str(tiny_weights.hps_dir),
        device="cpu",
    )
    report = score_rewards(request)
    assert events == [
        "check 8 images",  # both runs' images, once, before any model
        "load hpsv2 (0 loaded)",
        "load clipscore (0 loaded)",
        "load brightness (0 loaded)",
    ]
    assert report.rewards == ["hpsv2", "clipscore", "brightness"]
    assert all(ref() is None for ref in loaded)  # the last one is freed too

    # An unreadable image stops the run before any model loads.
    events.clear()
    (tmp_path / "other" / "0001_01.png").write_bytes(b"no png")
    with pytest.raises(FluxgrpoError, match=r"cannot read image .*0001_01\.png"):
        score_rewards(ScoreRequest(index=str(this), compare=str(other), reward="brightness,hpsv2", device="cpu"))
    assert events == ["check 8 images"]

    # So do a listed reward's missing weights, whatever its place in the list.
    events.clear()
    (tmp_path / "other" / "0001_01.png").unlink()
    hps_dir = tmp_path / "hps_without_imagereward"
    shutil.copytree(tiny_weights.hps_dir, hps_dir, ignore=shutil.ignore_patterns("imagereward"))
    with pytest.raises(FluxgrpoError, match=r"--reward imagereward's weights .*fetch-weights --only imagereward"):
        score_rewards(
            ScoreRequest(index=str(this), reward="brightness,imagereward", hps_dir=str(hps_dir), device="cpu")
        )
    assert not any(event.startswith("load") for event in events)


def test_reward_names_are_checked_before_anything_is_read(tmp_path, monkeypatch):
    import fluxgrpo.score as score_module

    def never(*args, **kwargs):
        raise AssertionError("nothing may be read or loaded for a bad --reward")

    monkeypatch.setattr(score_module, "load_scorer", never)
    monkeypatch.setattr(score_module, "images_from_index", never)
    missing = str(tmp_path / "no-such" / "index.json")  # not read: the names fail first

    def usage_error(reward: str) -> str:
        result = runner.invoke(app, ["score", "--index", missing, "--reward", reward, "--device", "cpu"])
        assert result.exit_code == 2, result.output
        return " ".join(result.stderr.split())  # unwrapped

    unknown = usage_error("hpsv2,nope,imagerewrd")
    assert "--reward: unknown reward 'nope', 'imagerewrd'" in unknown
    assert "hpsv2, pickscore, clipscore, imagereward, hpsv3, brightness" in unknown
    assert "--reward lists hpsv2 more than once" in usage_error("hpsv2,brightness,hpsv2")
    assert "has an empty name" in usage_error("hpsv2,,brightness")
    assert "name:weight is for `fluxgrpo train --reward`" in usage_error("hpsv2:1,brightness")
    both = usage_error("nope,brightness,brightness")  # every problem at once
    assert "unknown reward 'nope'" in both and "brightness more than once" in both
    with pytest.raises(UsageError, match="use score_rewards for several"):
        score(ScoreRequest(index=missing, reward="hpsv2,brightness"))


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares width × height over an empty image stream: PIL judges the size at open."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"") + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("side", [40000, 12000])
def test_an_oversized_image_is_refused_in_one_line_before_decoding(tmp_path, side):
    images = tmp_path / "images"
    images.mkdir()
    png_header_only(images / "bomb.png", side, side)
    (tmp_path / "p.txt").write_text("a red circle\n")
    result = runner.invoke(
        app,
        ["score", "--images", str(images), "--prompts", str(tmp_path / "p.txt"), "--reward", "brightness"],
    )
    assert result.exit_code == 1, result.output
    assert "bomb.png" in result.stderr and "cannot read image" in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    if side == 12000:  # below PIL's own bomb limit: fluxgrpo's limit refuses it, saying so
        assert "8192×8192" in result.stderr
