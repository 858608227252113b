"""Per-iteration metrics: ``metrics.jsonl`` on rank 0, plus TensorBoard / wandb when asked (imported only then)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fluxgrpo.errors import UsageError

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Appends one JSON object per iteration; a no-op on ranks other than 0."""

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = False,
        wandb: bool = False,
        config: dict[str, Any] | None = None,
        resume_after: int = 0,
    ) -> None:
        """Keep only records of iterations ≤ ``resume_after`` (0 for a fresh run): a run that died past its last
        checkpoint logged iterations that the resumed run repeats, and metrics.jsonl must read as one run."""
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / METRICS_FILE
        if path.is_file():
            kept = [r for r in read_metrics(output_dir) if r.get("iteration", 0) <= resume_after]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - held open for the run, closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError(
                    "--tensorboard needs the tensorboard package: pip install 'fluxgrpo[tensorboard]'"
                ) from None
            self._tb = SummaryWriter(str(output_dir / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise UsageError("--wandb needs the wandb package: pip install 'fluxgrpo[wandb]'") from None
            self._wandb = wandb_module.init(project="fluxgrpo", config=config, dir=str(output_dir))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        step = record.get("iteration")
        numeric = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "iteration"}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_trend(records: list[dict[str, Any]], window: int = 5) -> dict[str, float] | None:
    """Mean reward over the first and the last ``window`` iterations (None with fewer than 2 iterations)."""
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    if len(rewards) < 2:
        return None
    window = max(1, min(window, len(rewards) // 2))
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    return {"iterations": len(rewards), "window": window, "first": first, "last": last, "change": last - first}
