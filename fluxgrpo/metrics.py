"""Per-iteration metrics: ``metrics.jsonl`` on rank 0, plus TensorBoard / wandb when asked (imported only then)."""

from __future__ import annotations

import json
import math
import os
import platform
import secrets
import statistics
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fluxgrpo import __version__
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.headroom import share_used
from fluxgrpo.run_folder import (
    METRICS_FILE,
    RUN_INFO_FILE,
    WANDB_ID_FILE,
    open_run_file,
    read_run_file,
    write_run_file,
)
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.report import package_versions

if TYPE_CHECKING:
    from fluxgrpo.runtime.dist import DistContext


@dataclass(frozen=True)
class WandbRun:
    """Where ``--wandb`` logs: its project, the run's display name ("" lets wandb choose) and mode ("" its own)."""

    project: str = "fluxgrpo"
    name: str = ""
    mode: str = ""


class MetricsLogger:
    """Appends one JSON object per record; TensorBoard / wandb scalars, eval grids and reward histograms too.

    A no-op on ranks other than 0, except that ``log(..., histograms=...)`` gathers the tensors across ranks
    (a collective: every rank calls it) when a back-end that draws histograms is on.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = False,
        wandb: WandbRun | None = None,
        config: dict[str, Any] | None = None,
        resume_after: int = 0,
        ctx: DistContext | None = None,
        run_info: dict[str, Any] | None = None,
    ) -> None:
        """Keep only records of iterations ≤ ``resume_after`` (none for a fresh run, 0): a run that died past its
        last checkpoint logged iterations that the resumed run repeats, and metrics.jsonl must read as one run.

        ``wandb`` (None: off) says where wandb logs; ``ctx`` is needed only to gather histograms across ranks;
        ``run_info`` (versions and hardware, see ``run_info``) is written to ``run_info.json`` for
        ``fluxgrpo report``."""
        self.enabled = enabled
        self._ctx = ctx
        self._gathers = tensorboard or wandb is not None  # the same on every rank, so the collective matches
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / METRICS_FILE
        if path.is_file() or path.is_symlink():
            records = read_metrics(output_dir, on_torn_last_line=_say_torn_line_dropped)
            # From a checkpoint after iteration k, the run goes on at k + 1: its records up to k stay. Without one
            # (a run killed before its first checkpoint, resumed) it starts again at 0 and logs 0 again.
            kept = [r for r in records if r.get("iteration", 0) <= resume_after] if resume_after > 0 else []
            write_run_file(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open_run_file(path, "a")  # held open for the run, closed in close()
        if run_info is not None:
            write_run_file(output_dir / RUN_INFO_FILE, json.dumps(run_info, indent=2) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError(
                    "--tensorboard needs the tensorboard package: pip install 'fluxgrpo[tensorboard]'"
                ) from None
            # purge_step drops the events a crashed run wrote past the checkpoint we resume from
            self._tb = SummaryWriter(
                str(output_dir / "tensorboard"), purge_step=resume_after + 1 if resume_after else None
            )
        if wandb is not None:
            self._wandb = _start_wandb(output_dir, config, wandb)

    def log(self, record: dict[str, Any], histograms: dict[str, Any] | None = None) -> None:
        """One metrics.jsonl line; ``histograms`` (name → tensor of this rank's values) go to TensorBoard/wandb
        gathered over every rank."""
        if histograms and self._gathers and self._ctx is not None:
            histograms = {k: rt_dist.all_gather_tensor(self._ctx, v.detach().float()) for k, v in histograms.items()}
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        assert self._file is not None  # opened in __init__ whenever enabled
        self._file.write(json.dumps(clean) + "\n")
        step = record.get("iteration")
        numeric = {
            k: v
            for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "iteration" and math.isfinite(v)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        for key, values in (histograms or {}).items():
            self.log_histogram(key, values.cpu().numpy(), step)

    def log_histogram(self, tag: str, values: Any, step: int | None) -> None:
        """A histogram of a 1-D array of values (non-finite ones left out), rank 0 only: no gathering here."""

        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        if not self.enabled or not values.size:
            return
        if self._tb is not None:
            self._tb.add_histogram(tag, values, step)
        if self._wandb is not None:
            import wandb as wandb_module

            self._wandb.log({tag: wandb_module.Histogram(values)}, step=step)

    def log_image(self, tag: str, image: Any, step: int, caption: str = "") -> None:
        """An RGB image (HWC uint8 array) at ``step``: TensorBoard add_image, wandb.Image (rank 0 only)."""
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.add_image(tag, image, step, dataformats="HWC")
        if self._wandb is not None:
            import wandb as wandb_module

            self._wandb.log({tag: wandb_module.Image(image, caption=caption or None)}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(output_dir: Path, config: dict[str, Any] | None, where: WandbRun) -> Any:
    """A wandb run whose id is kept in ``output_dir/wandb_run_id``, so a resumed training continues that run."""
    try:
        import wandb as wandb_module
    except ImportError:
        raise UsageError("--wandb needs the wandb package: pip install 'fluxgrpo[wandb]'") from None
    id_file = output_dir / WANDB_ID_FILE
    run_id = read_run_file(id_file).strip() if id_file.is_file() or id_file.is_symlink() else ""
    if not run_id:
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        write_run_file(id_file, run_id + "\n")
    return wandb_module.init(
        project=where.project or "fluxgrpo",
        name=where.name or None,
        mode=where.mode or None,  # type: ignore[arg-type]  # config validation admits only wandb's modes
        id=run_id,
        resume="allow",
        config=config,
        allow_val_change=True,  # a resumed run may change its length, checkpointing or logging settings
        dir=str(output_dir),
    )


def run_info(ctx: DistContext) -> dict[str, Any]:
    """Versions and hardware of this run, for ``run_info.json`` (written once by rank 0)."""

    devices = rt_device.describe_devices(ctx.device_type)
    names = sorted({d.name for d in devices})
    return {
        "versions": {"fluxgrpo": __version__, "python": platform.python_version(), **package_versions()},
        "hardware": {
            "device_type": ctx.device_type,
            "world_size": ctx.world_size,
            "devices": ", ".join(names),
            "device_memory_gib": round(devices[0].total_bytes / 2**30, 1) if devices else None,
            "host": platform.node(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
    }


def read_metrics(output_dir: Path, on_torn_last_line: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of ``output_dir/metrics.jsonl`` ([] when there is none).

    A kill during an append can leave a torn last line. With ``on_torn_last_line`` it is dropped (a resume rewrites
    that iteration from its checkpoint anyway) and the callback is told in one line; without, it is refused like
    a torn line anywhere else.

    Raises:
        FluxgrpoError: a line that is not a JSON object, naming the file and the line.
    """
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file() and not path.is_symlink():
        return []
    with open_run_file(path, "rb") as f:
        data = f.read()
    lines = [(number, line) for number, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    records = []
    for position, (number, line) in enumerate(lines):
        try:
            record = json.loads(line.decode("utf-8"))  # binary garbage fails here, like torn JSON
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            where = f"{path} line {number}"
            # A kill during an append damages only the end: torn when no good record follows (binary junk may
            # hold newlines, so the tail can be several lines).
            if on_torn_last_line is not None and not any(_is_record(rest) for _, rest in lines[position + 1 :]):
                torn = f"last line of {where}" if position == len(lines) - 1 else f"tail of {where} to the end"
                on_torn_last_line(f"dropped the torn {torn} (a run killed while writing it)")
                break
            reason = "binary bytes" if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise FluxgrpoError(
                f"{where} is not a JSON record ({reason}): the file is damaged; restore it, or move it away to start "
                "the metrics over"
            ) from None
        records.append(record)
    return records


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except ValueError:
        return False


def _say_torn_line_dropped(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def held_out_trend(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each held-out reward's mean at the run's first and last evaluation (``eval_<reward>_mean``, the live
    weights'): ``{reward: {"first_iteration", "first", "last_iteration", "last", "change"[, "noise"][, "ceiling",
    "headroom_used"]}}``; empty with fewer than two evaluations. ``ceiling`` is the first evaluation's best-of-n
    (each prompt's best image, ``headroom.best_of_n_mean``) and ``headroom_used`` the change's share of
    ``ceiling − first``.

    ``noise`` is two standard errors of the change: a change inside it is what another draw of the images could give
    (a base model scored 0.66 on 60 images and 0.58 on 240), not an effect of training. The in-training evaluation
    draws every image from the same seed each time, so it logs the paired figure (``eval_<reward>_change_noise``
    against the evaluation at ``eval_change_from``, :func:`paired_change_noise`): each image's own difficulty cancels
    and the noise is smaller (±0.043 where the unpaired figure said ±0.057 on the shapes world). That figure is used,
    with ``"paired": 1.0``, when it was measured against this first evaluation; otherwise (runs from before it, or
    a first evaluation it was not measured against) the unpaired 2·√(s₀²/n₀ + s₁²/n₁) from the recorded image counts
    and spreads."""
    evaluations = [r for r in records if "eval_seconds" in r]
    if len(evaluations) < 2:
        return {}
    first, last = evaluations[0], evaluations[-1]
    out = {}
    for key, value in first.items():
        if key.startswith("eval_") and key.endswith("_mean") and not key.startswith("eval_ema_") and key in last:
            name = key.removeprefix("eval_").removesuffix("_mean")
            out[name] = {
                "first_iteration": first["iteration"],
                "first": value,
                "last_iteration": last["iteration"],
                "last": last[key],
                "change": last[key] - value,
            }
            ceiling = first.get(f"eval_{name}_best_of_n")
            if isinstance(ceiling, float):  # the base's best image per prompt: the headroom the change used a share of
                out[name]["ceiling"] = ceiling
                used = share_used(value, last[key], ceiling)
                if used is not None:
                    out[name]["headroom_used"] = used
            paired = last.get(f"eval_{name}_change_noise")
            if last.get("eval_change_from") == first["iteration"] and isinstance(paired, float):
                out[name]["noise"] = paired
                out[name]["paired"] = 1.0
                continue
            spread = f"eval_{name}_std"
            counted = all(isinstance(r.get("eval_images"), int) and r["eval_images"] > 0 for r in (first, last))
            if counted and isinstance(first.get(spread), float) and isinstance(last.get(spread), float):
                variance = first[spread] ** 2 / first["eval_images"] + last[spread] ** 2 / last["eval_images"]
                out[name]["noise"] = 2 * math.sqrt(variance)
    return out


def noise_verdict(change: dict[str, float]) -> str | None:
    """A held-out change (one of :func:`held_out_trend`'s) told apart from sampling noise, as train's closing line
    and the report's summary say it: ``within noise (±0.0420: …)``; None where no noise figure was measured."""
    if "noise" not in change:
        return None
    verdict = "within" if abs(change["change"]) <= change["noise"] else "beyond"
    what = (
        "2 standard errors of the per-image change, the same seeds at both"
        if change.get("paired")
        else "2 standard errors of the two evaluations' means"
    )
    return f"{verdict} noise (±{change['noise']:.4f}: {what})"


def paired_change_noise(before: list[float], after: list[float]) -> float | None:
    """Two standard errors of the mean per-image change between two evaluations of the same images' seeds,
    2·sd(d)/√n with d = after − before image by image (sd with n − 1): a paired comparison, so what makes one prompt
    or seed hard for both weights cancels. Pairs with a non-finite score are left out; None with fewer than 2 left.
    """
    if len(before) != len(after):
        raise ValueError(f"paired scores need as many images after ({len(after)}) as before ({len(before)})")
    changes = [b - a for a, b in zip(before, after, strict=True) if math.isfinite(a) and math.isfinite(b)]
    if len(changes) < 2:
        return None
    return 2 * statistics.stdev(changes) / math.sqrt(len(changes))


def reward_trend(records: list[dict[str, Any]], window: int = 5) -> dict[str, float] | None:
    """Mean reward over the first and the last ``window`` iterations (None with fewer than 2 iterations)."""
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    if len(rewards) < 2:
        return None
    window = max(1, min(window, len(rewards) // 2))
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    return {"iterations": len(rewards), "window": window, "first": first, "last": last, "change": last - first}
