"""Check 6: every reward whose weights are in place scores the same two reference images.

The images are drawn, not downloaded: a smooth colour gradient and a checkerboard with a disc, 256², in [0, 1]
(``reference_images``), with two fixed captions. Per reward (one result each):

- the fp32 scores are finite and the same when scored twice (deterministic inference);
- with ``--reward-dtype bf16`` the reward is loaded again in bf16 and each score must stay within
  ``DTYPE_TOLERANCE``·max(1, |fp32 score|) of the fp32 one (1e-2: bf16 encoders move a cosine-similarity score
  by about 1e-3; a score off by more than 1 % of its scale reorders images that GRPO's advantages tell apart);
- the authors' package (``hpsv2``, ``ImageReward``, ``hpsv3``) is looked up: whether it is importable is recorded.
  Scoring with it is not done here: those packages fetch their own weights from the network on first use, which
  a check must not do.

A reward without weights is skipped (``fetch-weights`` names the command), never passed; ``brightness`` has no
model and is not checked.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import torch

from fluxgrpo import rewards
from fluxgrpo.deepcheck.result import FAILED, PASSED, CheckResult, skipped

DTYPE_TOLERANCE = 1e-2
CAPTIONS = ["a smooth gradient from red to blue", "a black and white checkerboard with a yellow disc"]
AUTHORS_PACKAGES = {"hpsv2": "hpsv2", "imagereward": "ImageReward", "hpsv3": "hpsv3"}
RULE = "fp32 scores finite and repeatable; reward dtype within 1e-2·max(1,|s|)"


def reference_images(size: int = 256) -> torch.Tensor:
    """[2, 3, size, size] in [0, 1]: a red→blue gradient with a green ramp, and a checkerboard with a yellow disc."""

    ramp = torch.linspace(0.0, 1.0, size)
    gradient = torch.stack(
        [1 - ramp[None, :].expand(size, size), ramp[:, None].expand(size, size), ramp[None, :].expand(size, size)]
    )
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    board = (((rows // (size // 8)) + (cols // (size // 8))) % 2).float()
    disc = ((rows - size / 2) ** 2 + (cols - size / 2) ** 2 < (size / 4) ** 2).float()
    checker = torch.stack([torch.maximum(board, disc), torch.maximum(board, disc), board * (1 - disc)])
    return torch.stack([gradient, checker])


def check_rewards(
    names: list[str], hps_dir: str | Path, device: torch.device | str, reward_dtype: str
) -> list[CheckResult]:
    results = []
    images = reference_images().to(device)
    for name in names:
        parts = rewards.reward_weights_status(name, hps_dir)
        if not parts:
            continue  # no model (brightness)
        missing = [part for part in parts if not part.complete]
        if missing:
            results.append(
                skipped(
                    f"reward {name}",
                    RULE,
                    f"weights not in place ({'; '.join(missing[0].problems)}): {missing[0].fix or 'fetch-weights'}",
                )
            )
            continue
        start = time.perf_counter()
        fp32 = rewards.load_reward(name, hps_dir, device, "fp32")
        first = fp32(images, CAPTIONS).float().cpu()
        second = fp32(images, CAPTIONS).float().cpu()
        del fp32
        measured: dict[str, Any] = {"fp32_scores": first.tolist(), "reward_dtype": reward_dtype}
        problems = []
        if not bool(first.isfinite().all()):
            problems.append(f"fp32 scores not finite: {first.tolist()}")
        elif not bool((first == second).all()):
            problems.append(f"fp32 scores differ between two identical calls: {first.tolist()} vs {second.tolist()}")
        # The figure: how far the configured dtype moves the scores, or with fp32 how far a repeat does.
        figure = float((second - first).abs().max()) if bool(first.isfinite().all()) else float("nan")
        unit = "Δ fp32 repeat"
        if reward_dtype != "fp32" and not problems:
            unit = f"{reward_dtype} vs fp32"
            low = rewards.load_reward(name, hps_dir, device, reward_dtype)(images, CAPTIONS).float().cpu()
            measured[f"{reward_dtype}_scores"] = low.tolist()
            figure = float(((low - first).abs() / first.abs().clamp_min(1.0)).max())
            if not figure <= DTYPE_TOLERANCE:
                problems.append(f"{reward_dtype} scores {low.tolist()} are {figure:.1e} from fp32's {first.tolist()}")
        package = AUTHORS_PACKAGES.get(name)
        measured["authors_package"] = package
        measured["authors_package_importable"] = bool(package and importlib.util.find_spec(package))
        scores = ", ".join(f"{s:.4f}" for s in first.tolist())
        dtype_note = f"; {reward_dtype} within {figure:.1e}" if reward_dtype != "fp32" else ""
        results.append(
            CheckResult(
                f"reward {name}",
                FAILED if problems else PASSED,
                figure,
                unit,
                RULE,
                problems[0] if problems else f"scores {scores} (fp32){dtype_note}",
                measured,
                round(time.perf_counter() - start, 3),
            )
        )
    return results
