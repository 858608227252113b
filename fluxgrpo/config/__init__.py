"""Training configuration: one typed dataclass, DanceGRPO's names, validated before any worker starts.

Sources, later wins: the defaults (the Atlas A3 16-die recipe) → a YAML file (``--config``, a shipped name such as
``tiny-cpu`` or a path) → command-line flags. A YAML key is the flag without dashes, with underscores for hyphens
(``--num-generations`` ↔ ``num_generations``). A key set to ``null`` (or left empty) keeps the default. Unknown keys
are rejected, and every problem is reported at once.

The package: ``schema`` (the fields, their defaults and help), ``choices`` (the values an option may take, the
bounds), ``checks`` (every problem a config can have), ``files`` (shipped configs, YAML, building and saving). The
names the rest of fluxgrpo uses are importable from here.
"""

from fluxgrpo.config.choices import MAX_SEED, SAMPLERS
from fluxgrpo.config.files import build_config, config_summary, read_yaml, save_resolved, shipped_configs
from fluxgrpo.config.schema import TrainConfig, config_fields

__all__ = [
    "MAX_SEED",
    "SAMPLERS",
    "TrainConfig",
    "build_config",
    "config_fields",
    "config_summary",
    "read_yaml",
    "save_resolved",
    "shipped_configs",
]
