"""``fluxgrpo score``: reward scores of saved images against their prompts, per image, per prompt and overall.

Inputs, one of:

- ``--index DIR/index.json`` from ``fluxgrpo sample``: every image with its prompt, prompt and image index, seed;
- ``--images DIR --prompts FILE``: the images directly in DIR (.png, .jpg, .jpeg, .webp, .bmp; ``grid.png``, the
  contact sheet ``sample`` writes, is skipped), sorted by name with digit runs compared as numbers (``img2``
  before ``img10``), paired in that order with the non-blank lines of FILE, one line per image (repeated lines
  are kept: several images may share a prompt). The counts must match. Images with the same prompt text form
  one prompt group, numbered in order of first appearance.

A reward with its authors' own PIL input path has ``score_pil`` (HPSv2: RGB, longest side to 224, zero padding to
a square, CLIP normalisation; PickScore: the CLIP image processor; ...), and scores through it, batched, with the
encoders in float32 (``load_scorer``). Other rewards (``--reward brightness``, a smoke test) get the images as
[B, 3, H, W] tensors in [0, 1], a batch at a time when its images share a size, else one at a time.

Statistics: mean and population standard deviation (divide by n; 0 for a single image).
``--compare OTHER`` pairs images by (prompt_index, image_index); both runs must list the same pairs with the same
prompts and seeds. Per prompt it reports both means and ``difference = this − other``; overall
``mean_difference = mean(this) − mean(other)`` over all paired images (equal to the mean per-image difference),
and ``improved_fraction``: the share of prompts whose mean went up (difference > 0).

Several rewards (``--reward hpsv2,imagereward,hpsv3``, ``score_rewards``): the inputs are read and checked once
(index, files, image headers, the --compare pairing), then each reward in turn is loaded, scores every image (and
the other run's), and is freed before the next loads, so no two reward models are in memory at once (HPSv3 alone is
a 7B model). Each reward's report is exactly the one ``--reward NAME`` alone gives, bit for bit.

Nothing is written until every image is scored; the CSV is written to a temp file and renamed.
"""

from __future__ import annotations

import csv
import gc
import io
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fluxgrpo.data.prompts import read_prompts
from fluxgrpo.errors import FluxgrpoError, UsageError, not_usable
from fluxgrpo.headroom import Headroom, headroom
from fluxgrpo.paths import DEFAULT_HPS_DIR, check_replaceable_output, write_atomic
from fluxgrpo.rewards import reward_weights_status
from fluxgrpo.rewards.reward_set import reward_names_list
from fluxgrpo.rewards.scoring import (
    DEFAULT_SCORE_BATCH,
    ImageToScore,
    ScoredImage,
    check_images_readable,
    load_scorer,
    mean_std,
    reward_details,
    score_items,
)
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.sampling.folder import GRID_FILE, read_index

if TYPE_CHECKING:
    import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


# --------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class PromptScore:
    prompt_index: int
    prompt: str
    count: int
    mean: float
    std: float  # population std (divide by count)


@dataclass(frozen=True)
class Overall:
    count: int
    mean: float
    std: float


@dataclass(frozen=True)
class ComparedPrompt:
    prompt_index: int
    prompt: str
    count: int  # paired images of this prompt
    mean: float  # this run
    other_mean: float
    difference: float  # mean − other_mean


@dataclass(frozen=True)
class Comparison:
    other: str  # the other index
    count: int  # paired images
    mean: float
    other_mean: float
    mean_difference: float  # mean − other_mean
    improved_prompts: int  # prompts with difference > 0
    prompt_count: int
    improved_fraction: float  # improved_prompts / prompt_count
    prompts: list[ComparedPrompt]
    other_images: list[ScoredImage]  # the other run's scores, ordered as ``images`` of the report


@dataclass(frozen=True)
class ScoreReport:
    """Everything ``score`` measured; ``to_dict`` is the --json document."""

    reward: str
    source: dict[str, str]  # {"index": path} or {"images": dir, "prompts": file}
    images: list[ScoredImage]  # ordered by (prompt_index, image_index)
    prompts: list[PromptScore]
    overall: Overall
    comparison: Comparison | None = None
    # The reward's own numbers beside the mean (``RewardRecord.summarize``; shapes: strict, seen_*, novel_*).
    details: dict[str, float] = field(default_factory=dict)

    def headroom(self, threshold: float | None) -> Headroom:
        """Best-of-k and pass@k over the images of each prompt (``fluxgrpo.headroom``); ``threshold`` is what an
        image must score to pass (None: no pass@k)."""
        groups: dict[int, list[float]] = {}
        for image in self.images:
            groups.setdefault(image.prompt_index, []).append(image.score)
        return headroom({str(index): scores for index, scores in groups.items()}, threshold)

    def to_dict(self) -> dict[str, Any]:
        """Stable keys: reward, source, overall, details ({} for most rewards), prompts, images, compare (null
        without --compare)."""
        compare = None
        if self.comparison is not None:
            compare = asdict(self.comparison)
            compare.pop("other_images")
            others = {(o.prompt_index, o.image_index): o for o in self.comparison.other_images}
            compare["images"] = [
                {
                    "prompt_index": image.prompt_index,
                    "image_index": image.image_index,
                    "file": image.file,
                    "other_file": others[(image.prompt_index, image.image_index)].file,
                    "score": image.score,
                    "other_score": others[(image.prompt_index, image.image_index)].score,
                    "difference": image.score - others[(image.prompt_index, image.image_index)].score,
                }
                for image in self.images
            ]
        return {
            "reward": self.reward,
            "source": self.source,
            "overall": asdict(self.overall),
            "details": dict(self.details),
            "prompts": [asdict(p) for p in self.prompts],
            "images": [asdict(i) for i in self.images],
            "compare": compare,
        }


@dataclass(frozen=True)
class MultiScoreReport:
    """One ``ScoreReport`` per reward, for the same images (same order) and, with --compare, the same pairs."""

    reports: list[ScoreReport]  # in the order --reward lists the rewards

    @property
    def rewards(self) -> list[str]:
        return [report.reward for report in self.reports]

    def to_dict(self) -> dict[str, Any]:
        """The --json document. One reward: that reward's document (``ScoreReport.to_dict``), unchanged. Several:
        ``{"rewards": [one such document per reward, in --reward order]}``; each entry is exactly what
        ``--reward NAME --json`` alone prints."""
        if len(self.reports) == 1:
            return self.reports[0].to_dict()
        return {"rewards": [report.to_dict() for report in self.reports]}


@dataclass(frozen=True)
class ScoreRequest:
    """A scoring job; exactly one of ``index`` or (``images_dir`` and ``prompts_file``)."""

    index: str | None = None
    images_dir: str | None = None
    prompts_file: str | None = None
    reward: str = "hpsv2"  # one reward name, or several separated by commas (scored one after another)
    hps_dir: str = DEFAULT_HPS_DIR
    batch_size: int = DEFAULT_SCORE_BATCH
    device: str = "auto"
    compare: str | None = None  # another sample index

    def validate(self) -> ScoreRequest:
        if self.index is not None and (self.images_dir is not None or self.prompts_file is not None):
            raise UsageError("pass either --index or --images with --prompts, not both")
        if self.index is None and (self.images_dir is None or self.prompts_file is None):
            raise UsageError(
                "pass --index DIR/index.json (from `fluxgrpo sample`), or --images DIR with --prompts FILE"
            )
        if self.compare is not None and self.index is None:
            raise UsageError("--compare needs --index: images are paired by the prompt and image indexes of both runs")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1 (got {self.batch_size})")
        self.reward_list()
        return self

    def reward_list(self) -> list[str]:
        """The reward names ``reward`` lists, in order; UsageError naming every problem with them."""

        return reward_names_list(self.reward)


class _Pairable(Protocol):  # read-only members, so frozen dataclasses match
    @property
    def prompt(self) -> str: ...
    @property
    def prompt_index(self) -> int: ...
    @property
    def image_index(self) -> int: ...
    @property
    def seed(self) -> int | None: ...


_P = TypeVar("_P", bound=_Pairable)  # both runs' images are of one type, and the pairs keep it


# --------------------------------------------------------------------------------------------- inputs


def read_prompt_lines(path: str | Path) -> list[str]:
    """One prompt per image: each line stripped, repeats kept (unlike ``read_prompts``), blank lines at the end
    ignored. A blank line before the last prompt is refused: dropping it would pair every later image with the
    prompt of the one before.
    """

    prompts = read_prompts(path, keep_repeats=True)  # the file's errors, and at least one prompt
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    blank = [number for number, line in enumerate(lines, 1) if not line]
    if blank:
        raise FluxgrpoError(
            f"--prompts {path} line {blank[0]} is blank: with --images each line is the prompt of one image (in "
            "name order), so a blank line would shift every later pairing; write that image's prompt there or "
            "remove the line and its image"
        )
    return prompts


def natural_key(name: str) -> tuple[list[int | str], str]:
    """Sort key comparing digit runs as numbers: ``img2.png`` < ``img10.png``; ties broken by the exact name."""
    parts = re.split(r"(\d+)", name)
    return [int(part) if index % 2 else part.casefold() for index, part in enumerate(parts)], name


def list_images(directory: str | Path) -> list[Path]:
    """The images directly in ``directory`` (by suffix, ``grid.png`` skipped), in ``natural_key`` order."""

    folder = Path(directory)
    if not folder.is_dir():
        raise FluxgrpoError(f"--images {folder} is not a folder: pass the folder holding the images")
    found = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and p.name != GRID_FILE]
    if not found:
        raise FluxgrpoError(f"--images {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return sorted(found, key=lambda p: natural_key(p.name))


def images_from_folder(images_dir: str | Path, prompts_file: str | Path) -> list[ImageToScore]:
    """Pair the folder's images (name order) with the prompt file's lines (file order); see the module doc."""
    paths = list_images(images_dir)
    prompts = read_prompt_lines(prompts_file)
    if len(paths) != len(prompts):
        raise FluxgrpoError(
            f"{len(paths)} images in {images_dir} but {len(prompts)} prompt lines in {prompts_file}: "
            "give one prompt line per image, in the order of the image names"
        )
    group: dict[str, int] = {}
    seen: dict[str, int] = {}
    items = []
    for path, prompt in zip(paths, prompts, strict=True):
        prompt_index = group.setdefault(prompt, len(group))
        image_index = seen.get(prompt, 0)
        seen[prompt] = image_index + 1
        items.append(
            ImageToScore(
                path=path, file=path.name, prompt=prompt, prompt_index=prompt_index, image_index=image_index, seed=None
            )
        )
    return items


def images_from_index(index_path: str | Path) -> list[ImageToScore]:
    """Every image a sample index lists (``read_index`` checks it and its files)."""

    index = read_index(index_path)
    return [
        ImageToScore(
            path=index.image_path(image),
            file=image.file,
            prompt=image.prompt,
            prompt_index=image.prompt_index,
            image_index=image.image_index,
            seed=image.seed,
        )
        for image in index.images
    ]


def match_runs(this: Sequence[_P], other: Sequence[_P], this_name: str, other_name: str) -> list[tuple[_P, _P]]:
    """Pair two runs' images by (prompt_index, image_index), in ``this`` order.

    Raises:
        FluxgrpoError: an image is in one run only, or a pair differs in prompt or seed (the message says which).
    """
    others = {(o.prompt_index, o.image_index): o for o in other}
    mine = {(t.prompt_index, t.image_index) for t in this}
    fix = "compare runs sampled from the same prompts with the same --seed and --images-per-prompt"
    only_other = sorted(set(others) - mine)
    if only_other:
        key = only_other[0]
        raise FluxgrpoError(f"prompt {key[0]} image {key[1]} is in {other_name} but not in {this_name}: {fix}")
    pairs = []
    for image in this:
        key = (image.prompt_index, image.image_index)
        match = others.get(key)
        if match is None:
            raise FluxgrpoError(f"prompt {key[0]} image {key[1]} is in {this_name} but not in {other_name}: {fix}")
        if match.prompt != image.prompt:
            raise FluxgrpoError(
                f"prompt {key[0]} differs: {image.prompt!r} in {this_name} but {match.prompt!r} in {other_name}: {fix}"
            )
        if match.seed != image.seed:
            raise FluxgrpoError(
                f"prompt {key[0]} image {key[1]} has seed {image.seed} in {this_name} but {match.seed} in "
                f"{other_name}: {fix}"
            )
        pairs.append((image, match))
    return pairs


# --------------------------------------------------------------------------------------------- arithmetic


def per_prompt(images: Sequence[ScoredImage]) -> list[PromptScore]:
    """Mean and std of each prompt's scores, by prompt_index."""
    groups: dict[int, list[ScoredImage]] = {}
    for image in images:
        groups.setdefault(image.prompt_index, []).append(image)
    out = []
    for prompt_index in sorted(groups):
        scores = [image.score for image in groups[prompt_index]]
        mean, std = mean_std(scores)
        out.append(PromptScore(prompt_index, groups[prompt_index][0].prompt, len(scores), mean, std))
    return out


def overall(images: Sequence[ScoredImage]) -> Overall:
    mean, std = mean_std([image.score for image in images])
    return Overall(len(images), mean, std)


def compare_runs(
    this: Sequence[ScoredImage], other: Sequence[ScoredImage], other_name: str, this_name: str = "this run"
) -> Comparison:
    """Side by side per prompt, the mean difference (this − other) and the fraction of prompts improved."""
    pairs = match_runs(this, other, this_name, other_name)
    mine = [a for a, _ in pairs]
    theirs = [b for _, b in pairs]
    prompts = []
    other_by_prompt = {p.prompt_index: p for p in per_prompt(theirs)}
    for stats in per_prompt(mine):
        other_mean = other_by_prompt[stats.prompt_index].mean
        prompts.append(
            ComparedPrompt(
                stats.prompt_index, stats.prompt, stats.count, stats.mean, other_mean, stats.mean - other_mean
            )
        )
    improved = sum(p.difference > 0 for p in prompts)
    mean = overall(mine).mean
    other_mean = overall(theirs).mean
    return Comparison(
        other=other_name,
        count=len(pairs),
        mean=mean,
        other_mean=other_mean,
        mean_difference=mean - other_mean,
        improved_prompts=improved,
        prompt_count=len(prompts),
        improved_fraction=improved / len(prompts),
        prompts=prompts,
        other_images=theirs,
    )


# --------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class ScoreInputs:
    """What a request scores, read and checked once for every reward."""

    items: list[ImageToScore]  # ordered by (prompt_index, image_index)
    other_items: list[ImageToScore]  # the --compare run's; [] without it
    source: dict[str, str]


def read_inputs(request: ScoreRequest) -> ScoreInputs:
    """The request's images (and the --compare run's), every one checked: index, files, image headers, pairing."""
    if request.index is not None:
        items = images_from_index(request.index)
        source = {"index": str(request.index)}
    else:
        assert request.images_dir is not None and request.prompts_file is not None  # validate() requires both
        items = images_from_folder(request.images_dir, request.prompts_file)
        source = {"images": str(request.images_dir), "prompts": str(request.prompts_file)}
    items = sorted(items, key=lambda item: (item.prompt_index, item.image_index))
    other_items: list[ImageToScore] = []
    if request.compare is not None:
        other_items = images_from_index(request.compare)
        match_runs(items, other_items, str(request.index), str(request.compare))
    check_images_readable([*items, *other_items])
    return ScoreInputs(items, other_items, source)


def score_with_reward(
    name: str,
    inputs: ScoreInputs,
    request: ScoreRequest,
    device: torch.device | str,
    progress: Callable[[int], None] | None = None,
) -> ScoreReport:
    """Load reward ``name``, score ``inputs`` with it and summarise; the model is dropped when this returns."""
    scorer = load_scorer(name, request.hps_dir, device)
    images = score_items(inputs.items, scorer, request.batch_size, device, progress)
    comparison = None
    if request.compare is not None:
        others = score_items(inputs.other_items, scorer, request.batch_size, device, progress)
        comparison = compare_runs(images, others, str(request.compare), str(request.index))
    return ScoreReport(
        reward=name,
        source=inputs.source,
        images=images,
        prompts=per_prompt(images),
        overall=overall(images),
        comparison=comparison,
        details=reward_details(name, [image.prompt for image in images], [image.score for image in images]),
    )


def check_reward_weights(names: list[str], hps_dir: str | Path) -> None:
    """Refuse, naming the fetch command, when any listed reward's weights are incomplete: before the first model
    loads, not after an hour of scoring with the others."""

    for name in names:
        for part in reward_weights_status(name, hps_dir):
            if not part.complete:
                raise not_usable(f"--reward {name}'s weights in {part.path}", part.problems, part.fix)


def score_rewards(
    request: ScoreRequest,
    progress: Callable[[int], None] | None = None,
    on_reward: Callable[[str, int, int], None] | None = None,
) -> MultiScoreReport:
    """Score the images ``request`` names with every reward it lists, one reward model in memory at a time.

    Every input is checked (flags and reward names, index, files, image headers, pairing for --compare, every
    listed reward's weights) once, before the first reward model loads. ``on_reward(name, position, count)`` is
    called before reward ``name`` (position counted from 1) loads; ``progress(n)`` after every batch of n images.
    Each reward's model is freed (garbage-collected, the device's cache emptied) before the next one loads.

    Raises:
        UsageError: inconsistent flags, unknown or repeated reward names.
        FluxgrpoError: a missing, moved or unreadable input, a prompt count that does not match the images, two
            runs that cannot be compared; nothing is written in any of these cases.
    """

    names = request.validate().reward_list()
    inputs = read_inputs(request)
    check_reward_weights(names, request.hps_dir)
    device = rt_device.device_for_local_rank(rt_device.resolve_device_type(request.device), 0)
    reports = []
    for position, name in enumerate(names, start=1):
        if on_reward is not None:
            on_reward(name, position, len(names))
        reports.append(score_with_reward(name, inputs, request, device, progress))
        gc.collect()  # the scorer is unreachable now; collect any cycles it sat in before the next model loads
        rt_device.empty_cache(device)
    return MultiScoreReport(reports)


def score(request: ScoreRequest, progress: Callable[[int], None] | None = None) -> ScoreReport:
    """Score the images ``request`` names (and, with ``compare``, the other run's) with its one reward.

    ``progress(n)`` is called after every batch of n images. Every input is checked (index, files, image headers,
    pairing for --compare) before the reward model loads. For several rewards use ``score_rewards``.

    Raises:
        UsageError: inconsistent flags, an unknown reward, or more than one reward.
        FluxgrpoError: as ``score_rewards``.
    """
    if len(request.validate().reward_list()) != 1:
        raise UsageError(f"score() takes one reward (got --reward {request.reward}): use score_rewards for several")
    return score_rewards(request, progress).reports[0]


# --------------------------------------------------------------------------------------------- CSV


CSV_COLUMNS = ("file", "prompt_index", "image_index", "seed", "prompt", "score")
CSV_COMPARE_COLUMNS = ("other_file", "other_score", "difference")
# The start of every CSV this command writes (one reward or several): how --out recognises its own earlier file.
CSV_SIGNATURE = ",".join(CSV_COLUMNS[:5]).encode()


def check_csv_destination(path: str | Path) -> Path:
    """``--out`` can be written: its folder exists and is writable, and it is not a folder itself."""
    path = Path(check_replaceable_output(path, "--out", CSV_SIGNATURE, "a CSV that `fluxgrpo score` wrote"))
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise FluxgrpoError(f"cannot write {path}: its folder {folder} does not exist or is not writable (--out)")
    return path


def csv_text(report: ScoreReport) -> str:
    """One row per image; with a comparison also the other run's file, score and the difference."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    others = {}
    if report.comparison is not None:
        others = {(o.prompt_index, o.image_index): o for o in report.comparison.other_images}
    writer.writerow(CSV_COLUMNS + (CSV_COMPARE_COLUMNS if others else ()))
    for image in report.images:
        row = [
            image.file,
            image.prompt_index,
            image.image_index,
            "" if image.seed is None else image.seed,
            image.prompt,
            repr(image.score),
        ]
        if others:
            other = others[(image.prompt_index, image.image_index)]
            row += [other.file, repr(other.score), repr(image.score - other.score)]
        writer.writerow(row)
    return buffer.getvalue()


def multi_csv_text(report: MultiScoreReport) -> str:
    """One row per image. One reward: ``csv_text``'s columns. Several: ``score_<reward>`` per reward instead of
    ``score``; with a comparison also ``other_file``, ``other_score_<reward>`` and ``difference_<reward>``."""
    if len(report.reports) == 1:
        return csv_text(report.reports[0])
    names = report.rewards
    compared = report.reports[0].comparison is not None
    header = [*CSV_COLUMNS[:-1], *(f"score_{name}" for name in names)]
    if compared:
        header += ["other_file", *(f"other_score_{name}" for name in names)]
        header += [f"difference_{name}" for name in names]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row_index, image in enumerate(report.reports[0].images):
        scores = [r.images[row_index].score for r in report.reports]
        row = [image.file, image.prompt_index, image.image_index, "" if image.seed is None else image.seed]
        row += [image.prompt, *map(repr, scores)]
        if compared:
            others = [r.comparison.other_images[row_index] for r in report.reports if r.comparison is not None]
            row += [others[0].file, *(repr(other.score) for other in others)]
            row += [repr(mine - other.score) for mine, other in zip(scores, others, strict=True)]
        writer.writerow(row)
    return buffer.getvalue()


def write_csv(report: ScoreReport | MultiScoreReport, path: str | Path) -> Path:
    """Write the CSV to a temp file beside ``path`` and rename it: a reader never sees half a file."""
    path = check_csv_destination(path)
    text = multi_csv_text(report) if isinstance(report, MultiScoreReport) else csv_text(report)
    try:
        write_atomic(path, text, durable=True)
    except OSError as exc:
        raise FluxgrpoError(f"cannot write {path} ({exc.strerror or exc}): choose another --out") from None
    return path
