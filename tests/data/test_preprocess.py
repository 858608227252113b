"""Prompt files, DanceGRPO's embedding layout, ``preprocess`` (in-process and 2 processes) and its CLI."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.data.embeddings import EmbeddingDataset, embedding_files
from fluxgrpo.data.prompts import bundled_prompts_path, read_prompts
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.preprocess import preprocess, rank_indices

runner = CliRunner()
SEQ = 32  # the tiny_embeddings fixture's max_sequence_length


def _copy_embeddings(tiny_embeddings, tmp_path):
    out = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, out)
    return out


# --- prompt files -----------------------------------------------------------------------------------------------


def test_read_prompts_strips_drops_blanks_and_keeps_first_duplicate(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("  a cat  \n\n\t\nb dog\na cat\n  b dog\nc owl\r\n")
    assert read_prompts(path) == ["a cat", "b dog", "c owl"]


def test_read_prompts_errors_name_the_file_and_the_flag(tmp_path):
    with pytest.raises(FluxgrpoError, match=r"nope\.txt.*--prompts"):
        read_prompts(tmp_path / "nope.txt")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\t\n")
    with pytest.raises(FluxgrpoError, match=r"blank\.txt.*--prompts"):
        read_prompts(blank)


def test_bundled_prompts_are_at_least_100_distinct():
    prompts = read_prompts(bundled_prompts_path())
    assert len(prompts) >= 100
    assert len(set(prompts)) == len(prompts)


def test_rank_indices_cover_every_prompt_exactly_once():
    for count, world in [(10, 1), (10, 3), (2, 4), (0, 2)]:
        parts = [rank_indices(count, rank, world) for rank in range(world)]
        flat = sorted(i for part in parts for i in part)
        assert flat == list(range(count))
    assert rank_indices(10, 1, 3) == [1, 4, 7]


# --- the layout ---------------------------------------------------------------------------------------------------


def test_layout_files_json_shapes_and_dtypes(tiny_embeddings):
    out = tiny_embeddings.out_dir
    text = tiny_embeddings.index_path.read_text()
    assert text.startswith('[\n    {\n        "prompt_embed_path": "0.pt",')  # indent=4, DanceGRPO's key order
    entries = json.loads(text)
    assert entries[3] == {
        "prompt_embed_path": "3.pt",
        "text_ids": "3.pt",
        "pooled_prompt_embeds_path": "3.pt",
        "caption": tiny_embeddings.prompts[3],
    }
    assert [e["caption"] for e in entries] == tiny_embeddings.prompts
    for index in range(len(entries)):
        files = embedding_files(out, index)
        embeds = torch.load(files["prompt_embed"], weights_only=True)
        pooled = torch.load(files["pooled_prompt_embeds"], weights_only=True)
        text_ids = torch.load(files["text_ids"], weights_only=True)
        assert embeds.shape == (SEQ, 32) and pooled.shape == (32,) and text_ids.shape == (3,)
        assert embeds.dtype == pooled.dtype == text_ids.dtype == torch.float32  # cpu computes in float32
        assert not text_ids.any()


def test_stored_embeddings_are_those_of_their_caption(tiny_embeddings):
    from fluxgrpo.models.flux import encode_prompts, load_text_encoders

    encoders = load_text_encoders(tiny_embeddings.flux_dir)
    dataset = EmbeddingDataset(tiny_embeddings.index_path)
    fresh = encode_prompts(encoders, [dataset[5].caption], max_sequence_length=SEQ)
    torch.testing.assert_close(dataset[5].prompt_embeds, fresh.prompt_embeds[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(dataset[5].pooled, fresh.pooled[0], rtol=0, atol=1e-5)


def test_dataset_items_and_validation(tiny_embeddings):
    dataset = EmbeddingDataset(tiny_embeddings.index_path)
    assert len(dataset) == len(tiny_embeddings.prompts)
    item = dataset[2]
    assert item.caption == tiny_embeddings.prompts[2]
    assert item.prompt_embeds.shape == (SEQ, 32) and item.pooled.shape == (32,)
    assert item.text_ids.shape == (SEQ, 3) and not item.text_ids.any()  # the stored row, repeated per token
    info = dataset.validate(tiny_embeddings.flux_dir)
    assert (info.count, info.seq_len, info.embed_dim, info.pooled_dim, info.dtype) == (8, SEQ, 32, 32, "float32")


def test_validate_catches_embeddings_from_other_encoders(tiny_embeddings, tmp_path):
    other_flux = tmp_path / "flux"
    (other_flux / "transformer").mkdir(parents=True)
    (other_flux / "transformer" / "config.json").write_text(
        json.dumps({"joint_attention_dim": 4096, "pooled_projection_dim": 768})
    )
    with pytest.raises(
        FluxgrpoError, match=r"another model .*T5 width 32, CLIP width 32; .* 4096 and 768.*fluxgrpo preprocess"
    ):
        EmbeddingDataset(tiny_embeddings.index_path).validate(other_flux)


def test_missing_or_corrupt_file_is_one_clear_error(tiny_embeddings, tmp_path):
    out = _copy_embeddings(tiny_embeddings, tmp_path)
    embedding_files(out, 1)["pooled_prompt_embeds"].unlink()
    embedding_files(out, 4)["prompt_embed"].write_bytes(b"not a tensor")
    dataset = EmbeddingDataset(out / "videos2caption.json")
    with pytest.raises(FluxgrpoError, match=r"pooled_prompt_embeds/1\.pt is missing.*fluxgrpo preprocess"):
        dataset[1]
    with pytest.raises(FluxgrpoError, match=r"prompt_embed/4\.pt is damaged or not a torch file.*fluxgrpo preprocess"):
        dataset[4]
    with pytest.raises(FluxgrpoError, match=r"1\.pt is missing"):
        dataset.validate()
    with pytest.raises(FluxgrpoError, match=r"no embeddings index.*fluxgrpo preprocess"):
        EmbeddingDataset(tmp_path / "elsewhere" / "videos2caption.json")


# --- preprocess -----------------------------------------------------------------------------------------------------


def test_rerun_skips_valid_files_and_redoes_missing_or_corrupt_ones(tiny_embeddings, tmp_path):
    out = _copy_embeddings(tiny_embeddings, tmp_path)
    embedding_files(out, 2)["text_ids"].unlink()
    embedding_files(out, 6)["prompt_embed"].write_bytes(b"garbage")
    untouched = embedding_files(out, 0)["prompt_embed"]
    before = untouched.stat().st_mtime_ns
    summary = preprocess(tiny_embeddings.prompts_path, tiny_embeddings.flux_dir, out, SEQ, device="cpu")
    assert (summary.prompts, summary.encoded, summary.skipped) == (8, 2, 6)
    assert untouched.stat().st_mtime_ns == before
    EmbeddingDataset(out / "videos2caption.json").validate(tiny_embeddings.flux_dir)
    again = preprocess(tiny_embeddings.prompts_path, tiny_embeddings.flux_dir, out, SEQ, device="cpu")
    assert (again.encoded, again.skipped, again.dtype) == (0, 8, "float32")


def test_an_interrupted_run_never_looks_complete(tiny_embeddings, tmp_path, monkeypatch):
    from fluxgrpo import preprocess as module

    out = _copy_embeddings(tiny_embeddings, tmp_path)
    embedding_files(out, 3)["prompt_embed"].unlink()
    monkeypatch.setattr(module, "write_embedding", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        preprocess(tiny_embeddings.prompts_path, tiny_embeddings.flux_dir, out, SEQ, device="cpu")
    assert not (out / "videos2caption.json").exists()
    assert not list(out.rglob("*.tmp"))


def test_truncation_is_one_warning_that_counts(tiny_weights, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    # tiny T5: "a cat" = 3 tokens; each long prompt is 9 known words + </s> = 10 tokens > 8
    prompts.write_text("a cat\na red cat on a big old chair in snow\na blue dog on a big old chair in snow\n")
    summary = preprocess(prompts, tiny_weights.flux_dir, tmp_path / "emb", 8, device="cpu")
    assert summary.truncated == 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: 2 of 3 prompts are longer than 8 T5 tokens and were truncated to it"]


def test_a_folder_made_from_other_prompts_is_refused(tiny_embeddings, tmp_path):
    out = _copy_embeddings(tiny_embeddings, tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("a completely different prompt\n")
    with pytest.raises(FluxgrpoError, match=r"another prompt list.*--out"):
        preprocess(other, tiny_embeddings.flux_dir, out, SEQ, device="cpu")
    with pytest.raises(FluxgrpoError, match="--max-sequence-length"):
        preprocess(tiny_embeddings.prompts_path, tiny_embeddings.flux_dir, out, 16, device="cpu")


def test_kept_repeats_are_draws_of_one_encoding(tiny_weights, tmp_path):
    """--keep-repeats: a prompt on k lines is encoded once and listed k times in the index, in line order; without it
    the repeat is dropped, and a folder made one way is refused the other way (its index would list other draws)."""
    prompts = tmp_path / "weighted.txt"
    prompts.write_text("a red cube\na blue ball\na red cube\na red cube\n")
    out = tmp_path / "emb"
    summary = preprocess(prompts, tiny_weights.flux_dir, out, SEQ, device="cpu", keep_repeats=True)
    assert (summary.prompts, summary.draws, summary.encoded) == (2, 4, 2)
    entries = json.loads((out / "videos2caption.json").read_text())
    assert [(e["caption"], e["prompt_embed_path"]) for e in entries] == [
        ("a red cube", "0.pt"),
        ("a blue ball", "1.pt"),
        ("a red cube", "0.pt"),
        ("a red cube", "0.pt"),
    ]
    assert not embedding_files(out, 2)["prompt_embed"].exists()
    dataset = EmbeddingDataset(out / "videos2caption.json")
    assert len(dataset) == 4 and torch.equal(dataset[0].prompt_embeds, dataset[3].prompt_embeds)
    again = preprocess(prompts, tiny_weights.flux_dir, out, SEQ, device="cpu", keep_repeats=True)
    assert (again.encoded, again.skipped, again.draws) == (0, 2, 4)
    with pytest.raises(FluxgrpoError, match=r"another prompt list.*--out"):
        preprocess(prompts, tiny_weights.flux_dir, out, SEQ, device="cpu")
    once = preprocess(prompts, tiny_weights.flux_dir, tmp_path / "once", SEQ, device="cpu")
    assert (once.prompts, once.draws) == (2, 2)


def test_input_errors_come_before_any_model_loads(tiny_weights, tmp_path, monkeypatch):
    from fluxgrpo.models import flux

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(flux, "load_text_encoders", no_loading)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(FluxgrpoError, match="--prompts"):
        preprocess(empty, tiny_weights.flux_dir, tmp_path / "emb", SEQ, device="cpu")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(FluxgrpoError, match=r"cannot write embeddings.*--out"):
        preprocess(prompts, tiny_weights.flux_dir, blocker / "emb", SEQ, device="cpu")
    with pytest.raises(FluxgrpoError, match="fluxgrpo fetch-weights"):
        preprocess(prompts, tmp_path / "no-weights", tmp_path / "emb", SEQ, device="cpu")
    with pytest.raises(UsageError, match="--max-sequence-length"):
        preprocess(prompts, tiny_weights.flux_dir, tmp_path / "emb", 0, device="cpu")


# --- the CLI ----------------------------------------------------------------------------------------------------------


def test_cli_preprocess_in_process(tiny_embeddings, tmp_path):
    out = tmp_path / "emb"
    result = runner.invoke(
        app,
        [
            "preprocess",
            "--prompts",
            str(tiny_embeddings.prompts_path),
            "--model",
            str(tiny_embeddings.flux_dir),
            "--out",
            str(out),
            "--max-sequence-length",
            str(SEQ),
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["prompts"], summary["encoded"], summary["world_size"]) == (8, 8, 1)
    assert EmbeddingDataset(out / "videos2caption.json").captions == tiny_embeddings.prompts


def test_cli_keeps_the_balanced_sets_repeats_and_others_on_request(tiny_weights, tmp_path):
    from fluxgrpo.shapes import world

    def run(*args: str) -> dict:
        common = ["--model", str(tiny_weights.flux_dir), "--max-sequence-length", "8", "--device", "cpu", "--json"]
        result = runner.invoke(app, ["preprocess", *args, *common])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    balanced = world.prompt_set(world.BALANCED_TRAIN_SET)
    summary = run("--prompts", world.BALANCED_TRAIN_SET, "--out", str(tmp_path / "balanced"))
    assert (summary["prompts"], summary["draws"]) == (len(set(balanced)), len(balanced))
    assert EmbeddingDataset(tmp_path / "balanced" / "videos2caption.json").captions == list(balanced)
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\none\n")
    assert run("--prompts", str(prompts), "--out", str(tmp_path / "a"))["draws"] == 2
    assert run("--prompts", str(prompts), "--out", str(tmp_path / "b"), "--keep-repeats")["draws"] == 3


def test_cli_preprocess_exit_codes(tiny_weights, tmp_path):
    missing_prompts = runner.invoke(
        app,
        [
            "preprocess",
            "--prompts",
            str(tmp_path / "none.txt"),
            "--model",
            str(tiny_weights.flux_dir),
            "--out",
            str(tmp_path / "emb"),
        ],
    )
    assert missing_prompts.exit_code == 1 and "--prompts" in missing_prompts.stderr
    no_weights = runner.invoke(app, ["preprocess", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "e")])
    assert no_weights.exit_code == 1 and "fetch-weights" in no_weights.stderr
    assert runner.invoke(app, ["preprocess", "--dies", "0"]).exit_code == 2
    assert (
        runner.invoke(
            app,
            ["preprocess", "--device", "abacus", "--model", str(tiny_weights.flux_dir), "--out", str(tmp_path / "e")],
        ).exit_code
        == 2
    )


@pytest.mark.slow
def test_two_processes_write_every_prompt_once_and_match_one_process(tiny_embeddings, tmp_path, monkeypatch):
    # `--dies 2` runs `python -m fluxgrpo.runtime.agent --standalone --nproc-per-node=2 -m fluxgrpo.runtime.worker
    # fluxgrpo.preprocess ...` (torchrun)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 cores, 2 workers
    out = tmp_path / "emb"
    result = runner.invoke(
        app,
        [
            "preprocess",
            "--prompts",
            str(tiny_embeddings.prompts_path),
            "--model",
            str(tiny_embeddings.flux_dir),
            "--out",
            str(out),
            "--max-sequence-length",
            str(SEQ),
            "--dies",
            "2",
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    # 8 prompts over 2 ranks: 4 each, no padding duplicates, all encoded by this run
    assert (summary["world_size"], summary["prompts"], summary["encoded"], summary["skipped"]) == (2, 8, 8, 0)
    dataset = EmbeddingDataset(out / "videos2caption.json")
    assert dataset.captions == tiny_embeddings.prompts
    assert sorted(os.listdir(out / "prompt_embed")) == sorted(f"{i}.pt" for i in range(8))
    single = EmbeddingDataset(tiny_embeddings.index_path)
    for index in range(8):
        torch.testing.assert_close(dataset[index].prompt_embeds, single[index].prompt_embeds, rtol=0, atol=1e-5)
        torch.testing.assert_close(dataset[index].pooled, single[index].pooled, rtol=0, atol=1e-5)


def test_accelerator_precision_stores_bf16_like_dancegrpo(tiny_embeddings, tmp_path, monkeypatch):
    # On accelerators the runtime computes in bf16; cpu autocast exercises the same branch here.
    from fluxgrpo.runtime import device as rt_device

    monkeypatch.setattr(rt_device, "compute_dtype", lambda device_type: torch.bfloat16)
    out = tmp_path / "emb"
    summary = preprocess(tiny_embeddings.prompts_path, tiny_embeddings.flux_dir, out, SEQ, device="cpu")
    assert summary.dtype == "bfloat16"
    files = embedding_files(out, 0)
    assert all(torch.load(path, weights_only=True).dtype == torch.bfloat16 for path in files.values())
    dataset = EmbeddingDataset(out / "videos2caption.json")
    assert dataset.validate().dtype == "bfloat16"
    reference = EmbeddingDataset(tiny_embeddings.index_path)[0]
    torch.testing.assert_close(dataset[0].prompt_embeds.float(), reference.prompt_embeds, rtol=0.05, atol=0.05)
