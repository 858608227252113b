"""The ``shapes`` reward: a registry reward like any other, its strict rate and seen/novel scores, its prompt sets,
its one-line errors, and a tiny training run evaluated on the held-out captions."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.shapes import world
from fluxgrpo.shapes.world import PlacedObject, Scene, render

runner = CliRunner()


def _tensor(*images: np.ndarray) -> torch.Tensor:
    return torch.stack([torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 255.0 for image in images])


def _true_image(caption: str, seed: int = 0) -> np.ndarray:
    return world.render_caption(caption, seed)


def test_shapes_is_a_registry_reward_without_weights(tmp_path):
    from fluxgrpo.rewards import load_reward, reward_names, reward_weights_status

    assert "shapes" in reward_names()
    assert reward_weights_status("shapes", tmp_path) == []
    reward = load_reward("shapes", tmp_path)
    red_left = render(
        Scene(64, [PlacedObject("circle", "red", 14, 32, 8), PlacedObject("square", "yellow", 48, 30, 8)])
    )
    caption = "a red circle left of a yellow square"
    scores = reward(
        _tensor(red_left, red_left, _true_image("two blue triangles")),
        [caption, "a green circle left of a yellow square", "two blue triangles"],
    )
    # 5 claims; the green-circle caption fails only "the circle is green".
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx([1.0, 4 / 5, 1.0])


def test_shapes_scene_adds_the_nothing_else_claim_and_names_itself_in_its_errors(tmp_path):
    from fluxgrpo.rewards import load_reward, reward_names, reward_record

    assert "shapes-scene" in reward_names()
    reward = load_reward("shapes-scene", tmp_path)
    two = _true_image("two blue triangles")
    extra = render(Scene(64, [PlacedObject("circle", "red", 16, 32, 8), PlacedObject("square", "blue", 48, 32, 8)]))
    scores = reward(_tensor(two, extra), ["two blue triangles", "a red circle"])
    # 3 claims each: the count (or presence) and the colour, then nothing else; the blue square costs the third.
    assert scores.tolist() == pytest.approx([1.0, 2 / 3])
    assert load_reward("shapes", tmp_path)(_tensor(extra), ["a red circle"]).tolist() == [1.0]
    record = reward_record("shapes-scene")
    assert record.prompt_problems is not None and record.image_size_problems is not None
    assert record.prompt_problems(["a purple dog"])[0].startswith("--reward shapes-scene cannot read the prompt")
    assert record.image_size_problems(32, 32)[0].startswith("--reward shapes-scene checks 64 or 128-pixel")
    path = tmp_path / "extra.png"
    Image.fromarray(extra).save(path)
    assert record.explain is not None
    assert record.explain(path, "a red circle")[-1] == "✗ nothing else (1 object) (2 found)"


def test_shapes_strict_pays_only_when_every_scene_claim_holds(tmp_path):
    from fluxgrpo.rewards import load_reward, reward_record

    reward = load_reward("shapes-strict", tmp_path)
    two = _true_image("two blue triangles")
    extra = render(Scene(64, [PlacedObject("circle", "red", 16, 32, 8), PlacedObject("square", "blue", 48, 32, 8)]))
    # The extra blue square fails the scene claim (shapes-scene 2/3): all or nothing makes that 0; a wrong colour too.
    scores = reward(_tensor(two, extra, two), ["two blue triangles", "a red circle", "two red triangles"])
    assert scores.tolist() == [1.0, 0.0, 0.0]
    record = reward_record("shapes-strict")
    assert record.prompt_problems is not None
    assert record.prompt_problems(["a purple dog"])[0].startswith("--reward shapes-strict cannot read the prompt")


def test_summary_gives_the_strict_rate_and_seen_and_novel_apart():
    from fluxgrpo.rewards.shapes import summarize

    seen = next(t for t in world.prompt_set("shapes-heldout") if world.combination_kind(t) == "seen")
    novel = next(t for t in world.prompt_set("shapes-heldout") if world.combination_kind(t) == "novel")
    summary = summarize([seen, seen, novel, novel], [1.0, 0.5, 1.0, 0.25])
    assert summary == {
        "strict": 0.5,
        "seen": 0.75,
        "seen_strict": 0.5,
        "novel": 0.625,
        "novel_strict": 0.5,
    }
    assert summarize([seen], [float("nan")]) == {}
    assert set(summarize([seen], [1.0])) == {"strict", "seen", "seen_strict"}


def test_a_prompt_outside_the_world_is_one_line_naming_its_words(tmp_path):
    from fluxgrpo.rewards import load_reward

    reward = load_reward("shapes", tmp_path)
    with pytest.raises(FluxgrpoError, match=r"cannot read the prompt 'a purple dog'.*no word 'dog', 'purple'") as info:
        reward(_tensor(_true_image("a circle")), ["a purple dog"])
    assert "\n" not in str(info.value)


def test_an_image_of_the_wrong_size_is_one_line_naming_it(tmp_path):
    from fluxgrpo.rewards import load_reward

    with pytest.raises(FluxgrpoError, match=r"--reward shapes: a 32x32 image: the shapes world renders at 64x64"):
        load_reward("shapes", tmp_path)(torch.zeros(1, 3, 32, 32), ["a circle"])


def test_a_run_at_a_size_the_checker_cannot_read_is_refused_before_it_starts():
    from fluxgrpo.config import build_config

    with pytest.raises(UsageError, match=r"--reward shapes checks 64 or 128-pixel square images: use --height"):
        build_config("tiny-cpu", {"reward": "shapes", "height": 96, "width": 96})
    with pytest.raises(UsageError, match=r"--reward shapes checks"):
        build_config("tiny-cpu", {"eval_rewards": "shapes", "eval_every": 2, "height": 48, "width": 48})
    assert build_config("tiny-cpu", {"reward": "shapes"}).reward == "shapes"


def test_the_shipped_prompt_sets_are_the_worlds_and_are_named():
    from fluxgrpo.data.benchmarks import eval_prompts_path, eval_prompts_problem, prompts_path, shipped_set_path
    from fluxgrpo.data.prompts import read_prompts

    for name in world.PROMPT_SETS:
        assert tuple(read_prompts(shipped_set_path(name))) == world.prompt_set(name)
    assert prompts_path("shapes-train") == shipped_set_path("shapes-train")
    assert eval_prompts_path("shapes-heldout") == shipped_set_path("shapes-heldout")
    assert eval_prompts_problem("shapes-heldout") is None
    assert prompts_path("my.txt") == Path("my.txt")
    train, heldout = (set(world.prompt_set(name)) for name in world.PROMPT_SETS)
    assert not train & heldout
    assert {world.combination_kind(t) for t in heldout} == {"seen", "novel"}
    assert {world.combination_kind(t) for t in train} == {"seen"}


def test_the_balanced_training_set_draws_each_family_about_evenly_and_colours_twice():
    from collections import Counter

    from fluxgrpo.data.benchmarks import WEIGHTED_SETS, shipped_set_path
    from fluxgrpo.data.prompts import read_prompts

    balanced = world.prompt_set(world.BALANCED_TRAIN_SET)
    assert world.BALANCED_TRAIN_SET in WEIGHTED_SETS
    assert tuple(read_prompts(shipped_set_path(world.BALANCED_TRAIN_SET), keep_repeats=True)) == balanced
    assert set(balanced) <= set(world.prompt_set("shapes-train"))  # no caption of its own: held-out stays held out
    draws = Counter(world.parse_caption(t).family for t in balanced)
    train = Counter(world.parse_caption(t).family for t in world.prompt_set("shapes-train"))
    even = world.BALANCED_DRAWS_PER_FAMILY
    for family, captions in train.items():
        expected = even if captions > even else round(even / captions) * captions
        assert draws[family] == expected * (world.BALANCED_COLOUR_WEIGHT if family == "colors" else 1), family
    # A large family keeps distinct captions; a small one repeats every caption equally often.
    position = [t for t in balanced if world.parse_caption(t).family == "position"]
    assert len(set(position)) == len(position) == even
    assert set(Counter(t for t in balanced if world.parse_caption(t).family == "colors").values()) == {
        round(even / train["colors"]) * world.BALANCED_COLOUR_WEIGHT
    }


def _write_scored_folder(folder: Path, captions: list[str], wrong: set[int]) -> Path:
    folder.mkdir()
    lines = []
    for i, caption in enumerate(captions):
        image = _true_image(caption, seed=i)
        if i in wrong:
            image = np.full_like(image, 240)  # the empty background: nothing the caption asks for
        Image.fromarray(image).save(folder / f"{i:03d}.png")
        lines.append(caption)
    prompts = folder.parent / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    return prompts


def test_score_cli_prints_the_strict_rate_and_seen_and_novel(tmp_path):
    heldout = world.prompt_set("shapes-heldout")
    seen = [t for t in heldout if world.combination_kind(t) == "seen"][:2]
    novel = [t for t in heldout if world.combination_kind(t) == "novel"][:2]
    prompts = _write_scored_folder(tmp_path / "images", [*seen, *novel], wrong={3})
    argv = ["score", "--images", str(tmp_path / "images"), "--prompts", str(prompts), "--reward", "shapes"]
    result = runner.invoke(app, [*argv, "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [image["score"] for image in document["images"]] == [1.0, 1.0, 1.0, 0.0]
    assert document["details"] == {
        "strict": 0.75,
        "seen": 1.0,
        "seen_strict": 1.0,
        "novel": 0.5,
        "novel_strict": 0.5,
    }
    table = runner.invoke(app, [*argv, "--device", "cpu"])
    assert table.exit_code == 0
    assert "shapes: strict 0.75000 · seen 1.00000 · seen strict 1.00000 · novel 0.50000" in table.stdout


def test_score_cli_refuses_an_unparseable_caption_in_one_line(tmp_path):
    prompts = _write_scored_folder(tmp_path / "images", ["a circle"], wrong=set())
    prompts.write_text("a circle beside a dog\n")
    result = runner.invoke(
        app, ["score", "--images", str(tmp_path / "images"), "--prompts", str(prompts), "--reward", "shapes"]
    )
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'beside', 'dog'" in lines[0] and "shapes-train" in lines[0]


# --- a tiny training run on the world's captions, evaluated on the held-out set --------------------------------


@pytest.fixture(scope="module")
def shapes_run(tiny_weights, tmp_path_factory):
    from training_helpers import run

    from fluxgrpo.config import build_config
    from fluxgrpo.preprocess import preprocess

    root = tmp_path_factory.mktemp("shapes-run")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(world.prompt_set("shapes-train")[:4]) + "\n")
    summary = preprocess(prompts, tiny_weights.flux_dir, root / "embeddings", 32, device="cpu")
    cfg = build_config(
        "tiny-cpu",
        {
            "model": str(tiny_weights.flux_dir),
            "hps_dir": str(tiny_weights.hps_dir),
            "data_json_path": str(summary.index_path),
            "output_dir": str(root / "out"),
            "reward": "shapes",
            "max_train_steps": 1,
            "checkpointing_steps": 1,
            "save_images_every": 0,
            "num_generations": 4,
            "rollout_batch_size": 4,
            "train_micro_batch_size": 2,
            "sampling_steps": 4,
            "eval_every": 1,
            "eval_prompts": "shapes-heldout",
            "eval_steps": 2,
        },
    )
    return run(cfg), root / "out"


def test_training_on_the_world_logs_the_heldout_checker_seen_and_novel(shapes_run):
    from fluxgrpo.metrics import read_metrics

    _, out = shapes_run
    evals = [r for r in read_metrics(out) if "eval_shapes_mean" in r]
    assert [r["iteration"] for r in evals] == [0, 1]
    for record in evals:
        for key in ("strict", "seen", "seen_strict", "novel", "novel_strict"):
            assert 0.0 <= record[f"eval_shapes_{key}"] <= 1.0
    index = json.loads((out / "eval" / "iteration-0" / "index.json").read_text())
    per_image = index["scores"]["shapes"]["per_image"]
    assert len(per_image) == len(world.prompt_set("shapes-heldout"))
    assert index["scores"]["shapes"]["details"]["strict"] == evals[0]["eval_shapes_strict"]
    assert evals[0]["eval_shapes_strict"] == sum(s == 1.0 for s in per_image) / len(per_image)
    # `fluxgrpo score` on the evaluation's own images gives the same numbers.
    result = runner.invoke(
        app, ["score", "--index", str(out / "eval" / "iteration-0"), "--reward", "shapes", "--device", "cpu", "--json"]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["details"] == index["scores"]["shapes"]["details"]
    assert [image["score"] for image in document["images"]] == per_image


def test_render_caption_images_score_one_through_the_pil_path(tmp_path):
    captions = random.Random(0).sample(world.prompt_set("shapes-train"), 6)
    prompts = _write_scored_folder(tmp_path / "images", captions, wrong=set())
    result = runner.invoke(
        app,
        ["score", "--images", str(tmp_path / "images"), "--prompts", str(prompts), "--reward", "shapes", "--json"],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["overall"]["mean"] == 1.0


def test_report_captions_each_heldout_image_with_its_claims_and_plots_seen_and_novel(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    out = run / "eval" / "iteration-0"
    out.mkdir(parents=True)
    captions = ["a red circle left of a yellow square", "two blue triangles"]
    scenes = [
        Scene(64, [PlacedObject("circle", "green", 14, 32, 8), PlacedObject("square", "yellow", 48, 30, 8)]),
        Scene(64, [PlacedObject("triangle", "blue", 14, 14, 8), PlacedObject("triangle", "blue", 48, 14, 8)]),
    ]
    images = []
    for i, (caption, scene) in enumerate(zip(captions, scenes, strict=True)):
        Image.fromarray(render(scene)).save(out / f"{i:04d}_00.png")
        images.append({"file": f"{i:04d}_00.png", "prompt": caption, "prompt_index": i, "image_index": 0, "seed": i})
    index = {"format": "fluxgrpo-sample-index", "format_version": 1, "prompts": captions, "images": images}
    index["scores"] = {"shapes": {"mean": 0.9, "std": 0.1}}
    (out / "index.json").write_text(json.dumps(index))
    record = {"iteration": 0, "eval_shapes_mean": 0.9, "eval_shapes_std": 0.1, "eval_shapes_strict": 0.5}
    record |= {"eval_shapes_seen": 1.0, "eval_shapes_novel": 0.8}
    # a second evaluation that differs: a panel whose lines are flat is folded into one line (#31)
    later = record | {"iteration": 4, "eval_shapes_strict": 0.6, "eval_shapes_seen": 0.9, "eval_shapes_novel": 0.7}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(later) + "\n")
    result = runner.invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert "Eval shapes: novel, seen, strict (held-out prompts)" in document["panels"]
    assert "Eval shapes_seen (held-out prompts, mean ± std)" not in document["panels"]
    page = (run / "report.html").read_text(encoding="utf-8")
    for line in ("✓ a circle", "✗ the circle is red (green circle)", "✓ the circle is left of the square"):
        assert f"<div class=claims>{line}</div>" in page
    assert "<div class=claims>✓ two triangles</div><div class=claims>✓ the triangles are blue</div>" in page


def test_training_prompts_outside_the_world_are_refused_before_any_worker_starts(tiny_weights, tiny_embeddings):
    from fluxgrpo.config import build_config
    from fluxgrpo.training.launch_plan import preflight

    paths = {
        "model": str(tiny_weights.flux_dir),
        "hps_dir": str(tiny_weights.hps_dir),
        "data_json_path": str(tiny_embeddings.index_path),
    }
    with pytest.raises(UsageError, match=r"--reward shapes cannot read the prompt .*: the shapes world has no word"):
        preflight(build_config("tiny-cpu", {**paths, "reward": "shapes"}))
    # Evaluated only: the training prompts are brightness's business, the held-out ones the checker's.
    preflight(
        build_config("tiny-cpu", {**paths, "eval_every": 2, "eval_rewards": "shapes", "eval_prompts": "shapes-heldout"})
    )
    with pytest.raises(UsageError, match=r"evaluate on --eval-prompts shapes-heldout"):
        preflight(build_config("tiny-cpu", {**paths, "eval_every": 2, "eval_rewards": "shapes"}))
