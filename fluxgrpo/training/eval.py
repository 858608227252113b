"""Held-out evaluation during training: the same prompts, the same seeds, deterministic sampling, every reward.

At iteration 0 (the base model), every ``--eval-every`` K iterations and after the last one, the training loop
calls ``Evaluator``. It samples the held-out prompts exactly as ``fluxgrpo sample`` does (diffusers' FluxPipeline,
its deterministic flow-matching Euler sampler, η = 0, ``sample.image_seed`` with seed 0, the same file names,
grid and ``index.json``), but with the weights being trained: the pipeline wraps the live (possibly FSDP2-sharded)
transformer and the training VAE, and the prompts are encoded once, so no text encoder stays in memory. So
``eval/iteration-<k>/`` holds the images ``fluxgrpo sample --checkpoint <output_dir>/checkpoint-<k> --seed 0
--steps <eval-steps> --batch-size <rollout-batch-size> --max-sequence-length <S>`` would make (batches of
``rollout_batch_size``, known to fit in memory; S the T5 length the training prompts were preprocessed to, FLUX's 512
unless `preprocess --max-sequence-length` said otherwise), and two evaluations differ only by the weights. With ``--use-ema`` the EMA
weights are evaluated too (``eval/iteration-<k>-ema/``).

Prompt i is sampled by rank i % world (``preprocess.rank_indices``); every rank runs the same number of
transformer forwards (the ones with fewer prompts run discarded padding batches), as FSDP2 needs. Rank 0 gathers
the image records, writes the grid, scores every image with every reward through ``fluxgrpo score``'s own code
(the PNGs read back from disk, fp32 HPSv2), so ``fluxgrpo score --index eval/iteration-<k>`` reports the same
numbers, writes ``index.json`` last (with the iteration and the scores), logs ``eval_<reward>_mean/std``
and, with two or more images per prompt, ``eval_diversity`` (``diversity``, below; ``eval_ema_…`` for the EMA) to
metrics.jsonl at that iteration, and the grid and score histograms to TensorBoard / wandb. The loop hands the
record to the guards (``guards.py``).

Resume-safety: an evaluation at iteration k finishes before checkpoint k is written, so a run resumed from
checkpoint k already has it (metrics.jsonl keeps records up to k) and does not repeat it; one resumed from an
earlier checkpoint repeats iteration k's evaluation, replacing the folder and the record the dead run left.
Evaluation draws from no training RNG, so training numbers are the same with and without it.

Diversity: how different a prompt's images are from one another across seeds. RL fine-tuning collapses a prompt's
seeds towards one image (DanceGRPO's paper shows it) while every per-image reward still looks fine, so the
evaluation measures it directly. With ``--eval-images-per-prompt`` n ≥ 2, each image is embedded with the CLIP
image tower of a reward the evaluation already loads (the first of ``rewards/reward_set.py``'s ``EMBEDDING_REWARDS``
among the training and ``--eval-rewards`` rewards), L2-normalised, and

    diversity = mean over prompts of  mean over the n·(n−1)/2 pairs of that prompt's images of (1 − cos(fᵢ, fⱼ))

0 when a prompt's images are identical, larger as they spread (at most 2), the same whatever order the seeds come
in. It is logged as ``eval_diversity`` (``eval_ema_diversity`` for the EMA) and can be guarded (``--guard
diversity:-15%``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from PIL import Image

from fluxgrpo.config import TrainConfig
from fluxgrpo.data.benchmarks import TRAINING_SET, eval_prompts_path
from fluxgrpo.data.embeddings import EmbeddingDataset
from fluxgrpo.data.prompts import read_prompts
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.grpo.rollout import reshard_sharded_modules
from fluxgrpo.headroom import best_of_n_mean
from fluxgrpo.metrics import paired_change_noise
from fluxgrpo.preprocess import rank_indices
from fluxgrpo.rewards import scoring
from fluxgrpo.rewards.reward_set import embedding_reward, eval_reward_names
from fluxgrpo.rewards.scoring import DEFAULT_SCORE_BATCH, ImageToScore, load_image, mean_std, score_items
from fluxgrpo.run_folder import EVAL_DIR, INDEX_FILE
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.device import autocast
from fluxgrpo.runtime.worker import quiet_library_progress
from fluxgrpo.sampling.folder import clear_previous_run, read_index, write_grid, write_index
from fluxgrpo.sampling.generate import denoise, encode_prompt, generate_images
from fluxgrpo.sampling.request import SampledImage, SampleRequest, SampleSettings

if TYPE_CHECKING:
    from fluxgrpo.metrics import MetricsLogger
    from fluxgrpo.rewards.base import RewardFn
    from fluxgrpo.rewards.reward_set import RewardSet
    from fluxgrpo.runtime.dist import DistContext
    from fluxgrpo.training.parts import TrainingParts

EVAL_SEED = 0  # `fluxgrpo sample`'s default --seed: evaluations of different runs start from the same noise
EVAL_PROMPTS_FILE = "eval_prompts.txt"


def diversity(features: torch.Tensor, prompt_indices: Sequence[int]) -> float:
    """Mean over prompts (those with ≥ 2 images) of the mean pairwise cosine distance of their images' features.

    ``features`` [N, D] (any scale: normalised here), ``prompt_indices`` [N] the prompt of each row. NaN when no
    prompt has two images.
    """

    if features.shape[0] != len(prompt_indices):
        raise ValueError(f"{features.shape[0]} feature rows for {len(prompt_indices)} prompt indices")
    unit = F.normalize(features.double(), dim=-1)
    per_prompt = []
    for prompt in sorted(set(prompt_indices)):
        rows = [i for i, p in enumerate(prompt_indices) if p == prompt]
        if len(rows) < 2:
            continue
        group = unit[rows]
        cosine = group @ group.T
        upper = torch.triu_indices(len(rows), len(rows), offset=1)
        distances = (1.0 - cosine[upper[0], upper[1]]).clamp(min=0.0)
        per_prompt.append(float(distances.mean()))
    return math.fsum(per_prompt) / len(per_prompt) if per_prompt else math.nan


def image_diversity(scorer: Any, paths: Sequence[Path], prompt_indices: Sequence[int], batch_size: int) -> float:
    """``diversity`` of the images at ``paths`` in ``scorer.embed_pil``'s features, read back from disk."""

    rows = []
    for start in range(0, len(paths), batch_size):
        images = [load_image(path) for path in paths[start : start + batch_size]]
        with torch.no_grad():
            rows.append(scorer.embed_pil(images).float().cpu())
    return diversity(torch.cat(rows), prompt_indices)


def shipped_eval_prompts_path() -> Path:
    """48 held-out prompts across HPSv2's four styles (anime, concept art, paintings, photos), none of them in
    the shipped training prompts."""
    return Path(__file__).parent.parent / "data" / EVAL_PROMPTS_FILE


def eval_prompt_list(cfg: TrainConfig) -> list[str]:
    """The held-out prompts ``--eval-prompts`` names (the shipped set when empty), in order."""

    if cfg.eval_prompts == TRAINING_SET:  # the overfit check: the captions the run trains on, each once
        return list(dict.fromkeys(EmbeddingDataset(cfg.data_json_path).captions))
    path = eval_prompts_path(cfg.eval_prompts) if cfg.eval_prompts else shipped_eval_prompts_path()
    return read_prompts(path, flag="--eval-prompts")


def eval_folder(output_dir: str | Path, iteration: int, ema: bool = False) -> Path:
    return Path(output_dir) / EVAL_DIR / f"iteration-{iteration}{'-ema' if ema else ''}"


def training_text_length(cfg: TrainConfig) -> int:
    """S, the T5 length the training prompts were preprocessed to (512, FLUX's, unless `preprocess` was told
    otherwise)."""

    return int(EmbeddingDataset(cfg.data_json_path)[0].prompt_embeds.shape[0])


def is_due(cfg: TrainConfig, iteration: int) -> bool:
    """Iteration 0, every ``eval_every``-th, and the last."""
    if cfg.eval_every <= 0:
        return False
    return iteration % cfg.eval_every == 0 or iteration == cfg.max_train_steps


class Evaluator:
    """Runs the held-out evaluation when it is due; a no-op when ``--eval-every`` is 0. Call on every rank."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, metrics: MetricsLogger) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.metrics = metrics
        self.enabled = cfg.eval_every > 0
        if not self.enabled:
            return

        self.prompts = eval_prompt_list(cfg)
        self.rewards = eval_reward_names(cfg.reward, cfg.eval_rewards)
        self.settings = SampleSettings(
            height=cfg.height,
            width=cfg.width,
            steps=cfg.eval_steps,
            guidance=cfg.guidance,
            seed=EVAL_SEED,
            images_per_prompt=cfg.eval_images_per_prompt,
            batch_size=cfg.rollout_batch_size,
            attention=cfg.attention,
            # The held-out prompts are padded as the training prompts were (`preprocess --max-sequence-length`):
            # a model trained on short padded text (the shapes world's) is evaluated as it trains.
            max_sequence_length=training_text_length(cfg),
        ).validate()
        self._pipe: FluxPipeline | None = None
        self._encoded: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._scorers: dict[str, RewardFn] = {}
        # The evaluation every later one is compared with, image by image (``_paired_noise``).
        self._reference: PerImageScores | None = None

    # ----------------------------------------------------------------------------------------- entry points

    def before_training(self, start: int, parts: TrainingParts) -> dict[str, Any]:
        """Evaluate the weights the loop starts from (the base model at 0), unless a resumed run already did;
        returns the record (rank 0; ``{}`` elsewhere or when none ran)."""
        if not self.enabled or not is_due(self.cfg, start):
            return {}

        done = all(
            (eval_folder(self.cfg.output_dir, start, ema) / INDEX_FILE).is_file() for ema in self._variants(parts)
        )
        if start > 0 and rt_dist.broadcast_object(self.ctx, done):
            return {}
        return self.run(start, parts)

    def maybe_run(self, iteration: int, parts: TrainingParts) -> dict[str, Any]:
        """Evaluate after ``iteration`` when it is due (call before that iteration's checkpoint is saved); returns
        the record (rank 0; ``{}`` elsewhere or when none was due)."""
        if self.enabled and is_due(self.cfg, iteration):
            return self.run(iteration, parts)
        return {}

    def run(self, iteration: int, parts: TrainingParts) -> dict[str, Any]:
        """Evaluate the current weights (and the EMA's); returns the metrics record (rank 0; ``{}`` elsewhere)."""

        began = time.perf_counter()
        record: dict[str, Any] = {"iteration": iteration}
        # Sampling is inference: eval mode (no adapter dropout), as the rollout; and with --compile the rollout's
        # compiled graphs then serve the evaluation too.
        was_training = parts.transformer.training
        parts.transformer.eval()
        try:
            for ema in self._variants(parts):
                if ema:
                    with parts.ema.swap_into(parts.transformer):
                        record.update(self._evaluate(iteration, parts, ema=True))
                else:
                    record.update(self._evaluate(iteration, parts, ema=False))
        finally:
            parts.transformer.train(was_training)
        rt_device.empty_cache(self.ctx.device)
        record["eval_seconds"] = time.perf_counter() - began
        self.metrics.log(record)
        means = " · ".join(
            f"{k.removeprefix('eval_')} {v:.4f}" for k, v in record.items() if k.endswith(("_mean", "diversity"))
        )
        rt_dist.rank0_print(self.ctx, f"eval at iteration {iteration}: {means} ({record['eval_seconds']:.1f} s)")
        return record if self.ctx.is_main else {}

    @staticmethod
    def _variants(parts: TrainingParts) -> tuple[bool, ...]:
        return (False, True) if parts.ema is not None else (False,)

    # ----------------------------------------------------------------------------------------- one evaluation

    def _evaluate(self, iteration: int, parts: TrainingParts, ema: bool) -> dict[str, float]:
        ctx = self.ctx
        out = eval_folder(self.cfg.output_dir, iteration, ema)
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            clear_previous_run(out)  # a dead run's evaluation of this iteration, repeated after a resume
        rt_dist.wait_for_rank0(ctx, f"clearing {out}")
        request = SampleRequest(
            model=self.cfg.model,
            prompts=self.prompts,
            out_dir=str(out),
            checkpoint=None,
            ema=ema,
            settings=self.settings,
            device=self.cfg.device,
        )
        mine = rank_indices(len(self.prompts), ctx.rank, ctx.world_size)
        pipe = self._pipeline(parts)
        encoded = self._encodings()
        records = generate_images(pipe, request, mine, ctx, encoded=encoded) if mine else []
        self._pad_forwards(pipe, len(mine), encoded)
        reshard_sharded_modules(parts.transformer)

        gathered = rt_dist.all_gather_object(ctx, [asdict(r) for r in records])
        images = sorted(
            (SampledImage(**r) for part in gathered for r in part), key=lambda r: (r.prompt_index, r.image_index)
        )
        values: dict[str, float] = {}
        if ctx.is_main:
            dtype = rt_device.compute_dtype(ctx.device_type)
            values = self._finish(out, request, images, iteration, ema, dtype, parts.reward_fn)
        rt_dist.wait_for_rank0(ctx, f"scoring the evaluation of iteration {iteration}")  # rank 0 scores alone
        return values

    def _finish(
        self,
        out: Path,
        request: SampleRequest,
        images: list[SampledImage],
        iteration: int,
        ema: bool,
        dtype: torch.dtype,
        training_rewards: RewardSet,
    ) -> dict:
        """Rank 0: grid, scores, index.json (last), image and histograms to the trackers; the metrics values."""

        grid = write_grid(out, images, len(self.prompts), self.settings)
        scores = {name: self._score(self._scorer(name, training_rewards), out, images) for name in self.rewards}
        run = {
            "world_size": self.ctx.world_size,
            "device_type": self.ctx.device_type,
            "dtype": str(dtype).removeprefix("torch."),
        }
        summary = {name: _mean_std(values) for name, values in scores.items()}
        # A reward's own numbers (shapes: the strict rate, seen and novel combinations apart), as `score` prints.
        prompts = [image.prompt for image in images]
        details = {name: scoring.reward_details(name, prompts, values) for name, values in scores.items()}
        extra = {
            "iteration": iteration,
            "weights": f"training iteration {iteration}" + (" (EMA)" if ema else ""),
            "scores": {
                name: {
                    "mean": m,
                    "std": s,
                    "per_image": scores[name],
                    **({"details": details[name]} if details[name] else {}),
                }
                for name, (m, s) in summary.items()
            },
        }
        write_index(out, request, images, run, extra)
        prefix = "eval_ema_" if ema else "eval_"
        with Image.open(grid) as sheet:
            pixels = np.asarray(sheet.convert("RGB"))
        self.metrics.log_image(f"{prefix}grid", pixels, iteration, caption=f"iteration {iteration}")
        for name, values in scores.items():
            self.metrics.log_histogram(f"{prefix}{name}", np.asarray(values, dtype=np.float64), iteration)
        logged: dict[str, float] = {f"{prefix}images": len(images)}  # how many images each mean is over
        for name, (mean, std) in summary.items():
            logged[f"{prefix}{name}_mean"] = mean
            logged[f"{prefix}{name}_std"] = std
            logged.update({f"{prefix}{name}_{key}": value for key, value in details[name].items()})
        for name, values in scores.items():  # the ceiling of cheap improvement: each prompt's best image
            best = best_of_n_mean(prompts, values)
            if best is not None:
                logged[f"{prefix}{name}_best_of_n"] = best
        if not ema:
            logged.update(self._paired_noise(PerImageScores(iteration, _seeds(images), scores)))
        embedder = embedding_reward(self.rewards)
        if embedder is not None and self.settings.images_per_prompt > 1:
            logged[f"{prefix}diversity"] = image_diversity(
                self._scorer(embedder, training_rewards),
                [out / image.file for image in images],
                [image.prompt_index for image in images],
                DEFAULT_SCORE_BATCH,
            )
        return logged

    def _paired_noise(self, current: PerImageScores) -> dict[str, float]:
        """``eval_<reward>_change_noise`` (``metrics.paired_change_noise``) against the run's first evaluation of the
        live weights, and ``eval_change_from``, its iteration: the same seeds, so the change is read image by image.
        The first evaluation becomes that reference; a resumed run reads it back from the earliest evaluation
        folder. Nothing when the two drew different images (other prompts or seeds after a resume)."""

        if self._reference is None:
            self._reference = earliest_evaluation(self.cfg.output_dir, current.iteration) or current
        reference = self._reference
        if reference.iteration >= current.iteration or reference.seeds != current.seeds:
            return {}
        out: dict[str, float] = {}
        for name, after in current.scores.items():
            before = reference.scores.get(name)
            noise = paired_change_noise(before, after) if before is not None else None
            if noise is not None:
                out[f"eval_{name}_change_noise"] = noise
        return {**out, "eval_change_from": reference.iteration} if out else {}

    def _scorer(self, name: str, training: RewardSet) -> RewardFn:
        """The float32 reward model ``fluxgrpo score`` would load, kept for the run; the training reward's own model
        when that is the same one (``--reward-dtype fp32``), so rank 0 holds no second copy (HPSv3 is 31 GB)."""

        if name not in self._scorers:  # ``training``: the run's RewardSet
            if self.cfg.reward_dtype == "fp32" and name in training.names:
                self._scorers[name] = training.rewards[training.names.index(name)]
            else:
                self._scorers[name] = scoring.load_scorer(name, self.cfg.hps_dir, self.ctx.device)
        return self._scorers[name]

    def _score(self, scorer: RewardFn, out: Path, images: list[SampledImage]) -> list[float]:
        """Per-image scores, in (prompt, image) order, computed as ``fluxgrpo score --index`` computes them."""

        items = [
            ImageToScore(
                path=out / image.file,
                file=image.file,
                prompt=image.prompt,
                prompt_index=image.prompt_index,
                image_index=image.image_index,
                seed=image.seed,
            )
            for image in images
        ]
        scored = score_items(items, scorer, DEFAULT_SCORE_BATCH, self.ctx.device)
        return [image.score for image in scored]

    # ----------------------------------------------------------------------------------------- set-up

    def _pipeline(self, parts: TrainingParts) -> FluxPipeline:
        """A FluxPipeline around the live transformer and the training VAE, without text encoders."""
        if self._pipe is None:
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(self.cfg.model, subfolder="scheduler")
            self._pipe = FluxPipeline(
                scheduler=scheduler,
                vae=parts.vae,
                text_encoder=None,
                tokenizer=None,
                text_encoder_2=None,
                tokenizer_2=None,
                transformer=parts.transformer,
            )
            self._pipe.set_progress_bar_config(disable=True)
        return self._pipe

    def _encodings(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's prompts encoded once with `sample`'s code (text encoders loaded, used, and freed); a rank
        without prompts encodes prompt 0 for its padding forwards."""
        if self._encoded is None:
            with quiet_library_progress():
                encoders = FluxPipeline.from_pretrained(
                    self.cfg.model,
                    transformer=None,
                    vae=None,
                    dtype=rt_device.compute_dtype(self.ctx.device_type),
                    trust_remote_code=False,
                )
            encoders = encoders.to(self.ctx.device)
            mine = rank_indices(len(self.prompts), self.ctx.rank, self.ctx.world_size) or [0]
            length = self.settings.max_sequence_length
            self._encoded = {i: encode_prompt(encoders, self.prompts[i], self.ctx, length) for i in mine}
            del encoders
            rt_device.empty_cache(self.ctx.device)
        return self._encoded

    def _pad_forwards(
        self, pipe: FluxPipeline, prompts_here: int, encoded: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Discarded pipeline calls so this rank runs as many sharded forwards as the busiest rank."""

        if not self.ctx.distributed:
            return
        settings = self.settings
        busiest = math.ceil(len(self.prompts) / self.ctx.world_size)
        calls = math.ceil(busiest * settings.images_per_prompt / settings.batch_size)
        done = math.ceil(prompts_here * settings.images_per_prompt / settings.batch_size)
        embeds, pooled = next(iter(encoded.values()))
        for _ in range(calls - done):
            with torch.no_grad(), autocast(self.ctx.device_type):
                denoise(pipe, settings, embeds, pooled, [EVAL_SEED], output_type="latent")


@dataclass(frozen=True)
class PerImageScores:
    """One evaluation's per-image scores of each reward, with the (prompt, seed) of every image in order."""

    iteration: int
    seeds: list[tuple[str, int]]
    scores: dict[str, list[float]]


def _seeds(images: list[SampledImage]) -> list[tuple[str, int]]:
    return [(image.prompt, image.seed) for image in images]


def earliest_evaluation(output_dir: str | Path, before: int) -> PerImageScores | None:
    """The per-image scores of the earliest evaluation of the live weights in ``output_dir`` before iteration
    ``before`` (read from its ``index.json``); None when there is none or it cannot be read (then no paired noise
    is logged: a damaged old folder never stops a run)."""

    folders = []
    for folder in (Path(output_dir) / EVAL_DIR).glob("iteration-*"):
        number = folder.name.removeprefix("iteration-")
        if number.isdigit() and int(number) < before:
            folders.append((int(number), folder))
    if not folders:
        return None
    iteration, folder = min(folders)
    try:
        index = read_index(folder)
        document = json.loads(index.path.read_text(encoding="utf-8"))
        scores = {name: [float(v) for v in entry["per_image"]] for name, entry in document["scores"].items()}
    except (FluxgrpoError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return PerImageScores(iteration, _seeds(index.images), scores)


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std, as ``fluxgrpo score`` reports them (NaN when there is no finite value)."""

    finite = [v for v in values if math.isfinite(v)]
    return mean_std(finite) if finite else (math.nan, math.nan)


def per_prompt_change(output_dir: str | Path, first: int, last: int) -> dict[str, list[dict[str, Any]]]:
    """Each held-out reward's per-prompt mean at two evaluations of the live weights (the overfit check's table):
    ``{reward: [{"prompt", "images", "first", "last"[, "first_strict", "last_strict"]}]}``; the shapes checker's
    rewards also give the share of images where every claim holds. Empty when either evaluation cannot be read."""

    documents = []
    for iteration in (first, last):
        try:
            index = read_index(eval_folder(output_dir, iteration))
            documents.append((index.images, json.loads(index.path.read_text(encoding="utf-8"))["scores"]))
        except (FluxgrpoError, OSError, ValueError, KeyError, TypeError):
            return {}
    (images, before), (later_images, after) = documents
    if [(i.prompt, i.seed) for i in images] != [(i.prompt, i.seed) for i in later_images]:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for name in before.keys() & after.keys():
        rows: dict[str, dict[str, list[float]]] = {}
        for image, b, a in zip(images, before[name]["per_image"], after[name]["per_image"], strict=True):
            row = rows.setdefault(image.prompt, {"first": [], "last": []})
            row["first"].append(float(b))
            row["last"].append(float(a))
        strict = name in ("shapes", "shapes-scene", "shapes-strict")  # a score of 1.0: every claim holds
        table = []
        for prompt, row in rows.items():
            entry: dict[str, Any] = {"prompt": prompt, "images": len(row["first"])}
            for when in ("first", "last"):
                finite = [v for v in row[when] if math.isfinite(v)]
                entry[when] = sum(finite) / len(finite) if finite else math.nan
                if strict:
                    entry[f"{when}_strict"] = sum(v >= 1.0 for v in finite) / len(finite) if finite else math.nan
            table.append(entry)
        out[name] = table
    return out
