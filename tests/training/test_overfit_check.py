"""The overfit check's pieces: ``--eval-prompts training`` evaluates the run's own captions, and the closing table
reads each prompt's change between two evaluations of the same seeds."""

from __future__ import annotations

import json

from test_score import hand_made_index

from fluxgrpo.config import TrainConfig
from fluxgrpo.data.embeddings import write_index
from fluxgrpo.training.eval import eval_folder, eval_prompt_list, per_prompt_change


def test_training_as_eval_prompts_reads_the_runs_captions_once_each(tmp_path):
    (tmp_path / "emb").mkdir()
    index = write_index(tmp_path / "emb", ["three circles", "a red square", "three circles"])
    cfg = TrainConfig(data_json_path=str(index), eval_prompts="training")
    assert eval_prompt_list(cfg) == ["three circles", "a red square"]


def _evaluation(run, iteration: int, scores: list[list[float]]) -> None:
    folder = eval_folder(run, iteration)
    index = hand_made_index(folder, ["two circles", "a red square"], [[51, 102], [153, 204]], [[0, 1], [0, 1]])
    document = json.loads(index.read_text())
    flat = [s for row in scores for s in row]
    document["scores"] = {"shapes": {"mean": sum(flat) / len(flat), "std": 0.0, "per_image": flat}}
    index.write_text(json.dumps(document))


def test_per_prompt_change_between_two_evaluations_of_the_same_seeds(tmp_path):
    _evaluation(tmp_path, 0, [[0.5, 1.0], [0.0, 0.5]])
    _evaluation(tmp_path, 30, [[1.0, 1.0], [0.5, 0.5]])
    table = per_prompt_change(tmp_path, 0, 30)["shapes"]
    assert [row["prompt"] for row in table] == ["two circles", "a red square"]
    first, second = table
    assert (first["first"], first["last"], first["first_strict"], first["last_strict"]) == (0.75, 1.0, 0.5, 1.0)
    assert (second["first"], second["last"], second["first_strict"], second["last_strict"]) == (0.25, 0.5, 0.0, 0.0)
    assert first["images"] == 2
    assert per_prompt_change(tmp_path, 0, 60) == {}  # an evaluation that cannot be read: no table


def test_training_is_a_valid_eval_prompts_value():
    from fluxgrpo.data.benchmarks import eval_prompts_problem

    assert eval_prompts_problem("training") is None
    assert "training" in (eval_prompts_problem("no-such-set") or "")
