"""Config files: the shipped configs (package data, addressable by name), reading a YAML file, building the
validated config from defaults → file → flags, and saving the resolved config with a run."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fluxgrpo.config.checks import unread_flag_problems
from fluxgrpo.config.schema import TrainConfig, config_fields
from fluxgrpo.errors import UsageError
from fluxgrpo.run_folder import write_run_file
from fluxgrpo.yaml_reader import capped, read_config_yaml


def shipped_configs() -> dict[str, Path]:
    """Config name → file for the YAML files inside the package (``fluxgrpo/configs``)."""
    folder = resources.files("fluxgrpo") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def config_summary(path: Path) -> str:
    """The first comment lines of a shipped config: what it is and the command that launches it."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return "\n".join(lines)


def resolve_config_path(name_or_path: str) -> Path:
    shipped = shipped_configs()
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise UsageError(
        f"--config {name_or_path!r} is neither a shipped config ({', '.join(sorted(shipped))}) nor a file; "
        "see `fluxgrpo train --list-configs`"
    )


def read_yaml(path: Path) -> dict[str, Any]:
    data = read_config_yaml(path) or {}  # bounded in size and depth, no aliases, no key twice
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a mapping of option names to values")
    return data


def build_config(config: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults → YAML file → flag overrides (None values mean "not given"), validated.

    Raises:
        UsageError: unknown keys, wrong types, or inconsistent values (all listed together).
    """
    values: dict[str, Any] = {}
    problems: list[str] = []
    known = {f.name: f for f in config_fields()}
    if config:
        path = resolve_config_path(config)
        for key, value in read_yaml(path).items():
            key = str(key).replace("-", "_")
            if key not in known:
                problems.append(f"{path}: unknown key {key!r}")
                continue
            if value is None:  # `output_dir:` or `output_dir: null` means "the default", not the string "None"
                continue
            values[key] = value
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    for key, value in list(values.items()):
        try:
            values[key] = _coerce(known[key], value)
        except (TypeError, ValueError):
            problems.append(f"{key}: {value!r} is not a valid {known[key].type}")
    if problems:
        raise UsageError("invalid training configuration:\n  - " + "\n  - ".join(capped(problems)))
    cfg = TrainConfig(**values).validate()
    unread = unread_flag_problems(cfg, [key for key, value in (overrides or {}).items() if value is not None])
    if unread:
        raise UsageError("invalid training configuration:\n  - " + "\n  - ".join(unread))
    return cfg


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(value)
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    return str(value)


def save_resolved(cfg: TrainConfig, path: Path, derived: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write the resolved config (loadable with --config) with the derived numbers as a comment block."""

    header = ["# Resolved fluxgrpo training config (load it again with --config <this file>).", "# Derived:"]
    header += [f"#   {k}: {v}" for k, v in derived.items()]
    for k, v in (extra or {}).items():
        header.append(f"#   {k}: {v}")

    path.parent.mkdir(parents=True, exist_ok=True)
    write_run_file(path, "\n".join(header) + "\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
