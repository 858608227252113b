"""The baseline's row from an earlier algorithm comparison, instead of training the baseline again.

``fluxgrpo bench --algorithms mixgrpo,nft --config C --baseline-from earlier.json`` trains mixgrpo and nft only and
compares them with the ``dance`` row of ``earlier.json`` (a ``bench --algorithms ... --json`` document). Training is
deterministic from seeded generators (every repeat reproduces its rewards bitwise, which the bench checks), so the
baseline trained again under the same settings would read the same gains and curves; only its times would be of
another hour. A campaign can then add options block by block, each block costing the options alone.

The earlier document is only trusted where it was made under the same settings: the bench's own (iterations,
prompts, text tokens, weights seed, repeats, seed variation, device) and the whole resolved training config the
baseline trained with, compared key by key (a key one side lacks counts as its default, so a document written before
a new option existed still matches at that option's neutral setting). ``--config`` is compared by what it resolves
to, not by its name, so a YAML moved to another folder still matches and one edited under the same name does not.
Anything else is refused, naming what differs. The file is read as JSON: nothing in it runs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.config import TrainConfig
from fluxgrpo.errors import UsageError

if TYPE_CHECKING:
    from fluxgrpo.bench.efficiency import EfficiencyConfig

# The bench settings that decide what the baseline's runs were (the algorithm list and the output flags do not).
DECIDING_SETTINGS = (
    "iterations",
    "prompts",
    "text_tokens",
    "seed",
    "repeats",
    "vary_seed",
    "device",
    "base_overrides",
)
# What a comparison needs of the baseline's row: the ratios, the time verdicts and the held-out verdicts read these.
REQUIRED_FIELDS = (
    "algorithm",
    "iterations",
    "repeats",
    "seconds_per_iteration",
    "seconds_per_iteration_spread",
    "reward_gain",
    "reward_gain_spread",
    "reward_gain_per_second",
    "rewards_identical",
    "heldout_gain",
)
SHOWN_DIFFERENCES = 6


@dataclass(frozen=True)
class ReusedBaseline:
    """The earlier document's baseline row and the training config it ran with."""

    path: Path
    row: dict[str, Any]
    training: dict[str, Any]

    def check_training(self, current: dict[str, Any]) -> None:
        """Refuse unless ``current`` (this bench's resolved training config, workspace paths left out) is the one the
        baseline trained with."""
        defaults = TrainConfig().to_dict()
        here = json.loads(json.dumps(current, default=str))
        differ = [
            f"{key}: {self.training.get(key, defaults.get(key))!r} there, {here.get(key, defaults.get(key))!r} here"
            for key in sorted(set(self.training) | set(here))
            if self.training.get(key, defaults.get(key)) != here.get(key, defaults.get(key))
        ]
        if differ:
            raise _mismatch(self.path, "its baseline trained with another training config", differ)

    def as_row(self) -> dict[str, Any]:
        """The row as this comparison shows it: the earlier one, marked with the file it came from (the first
        file's, where that document took it from another in turn, as its times are)."""
        return {"baseline_from": str(self.path), **self.row}


def load_baseline(cfg: EfficiencyConfig, baseline: str) -> ReusedBaseline:
    """The ``baseline`` row of ``cfg.baseline_from``, refused (naming the flag and what differs) unless that document
    is a bench comparison made under ``cfg``'s deciding settings."""
    assert cfg.baseline_from is not None
    path = Path(cfg.baseline_from)
    not_ours = f"--baseline-from {path}: not the JSON of `fluxgrpo bench --algorithms ... --json`"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{not_ours} ({error})") from None
    if not isinstance(document, dict):
        raise UsageError(not_ours)
    earlier, rows = document.get("config"), document.get("algorithms")
    if not isinstance(earlier, dict) or not isinstance(rows, list) or not isinstance(earlier.get("training"), dict):
        raise UsageError(not_ours)
    row = next((row for row in rows if isinstance(row, dict) and row.get("algorithm") == baseline), None)
    if row is None:
        raise UsageError(f"--baseline-from {path}: it has no {baseline} row; run the bench with {baseline} first")
    missing = [name for name in REQUIRED_FIELDS if name not in row]
    if missing:
        raise UsageError(f"{not_ours}: its {baseline} row lacks {', '.join(missing)}")
    here = json.loads(json.dumps({name: getattr(cfg, name) for name in DECIDING_SETTINGS}, default=str))
    defaults = json.loads(json.dumps(dataclasses.asdict(type(cfg)()), default=str))
    differ = [
        f"{'--' + name.replace('_', '-')}: {earlier.get(name, defaults[name])!r} there, {here[name]!r} here"
        for name in DECIDING_SETTINGS
        if earlier.get(name, defaults[name]) != here[name]
    ]
    if differ:
        raise _mismatch(path, "it was measured with other bench settings", differ)
    return ReusedBaseline(path, row, earlier["training"])


def _mismatch(path: Path, why: str, differ: list[str]) -> UsageError:
    shown = "; ".join(differ[:SHOWN_DIFFERENCES])
    more = f"; and {len(differ) - SHOWN_DIFFERENCES} more" if len(differ) > SHOWN_DIFFERENCES else ""
    return UsageError(
        f"--baseline-from {path}: {why} ({shown}{more}); run with the same settings, or drop --baseline-from to "
        "train the baseline again"
    )
