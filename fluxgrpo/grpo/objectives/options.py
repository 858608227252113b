"""An objective's own settings as the command line and the config files see them, without torch.

A settings class is a frozen dataclass deriving from ``Options``: a ``prefix`` and fields made with ``option`` (the
default, the flag's help, and whether the flag is ``exclusive``: set off its default for an objective that does not
read it, it is refused). Its field ``beta`` with prefix ``nft`` is the flag ``--nft-beta`` and the YAML key
``nft_beta`` (``OptionField.key``); ``problems`` are its own checks, each naming the flag that fixes it. The run's
config holds one instance of every registered class (``OptionSet``) and generates the flags from them
(``config.schema.config_fields``), so an objective's flags never touch ``TrainConfig``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

SettingsT = TypeVar("SettingsT", bound="Options")


def option(default: Any, help: str, *, exclusive: bool = False) -> Any:
    """A settings field: its default, its flag's help, and whether an objective not reading it refuses it off its
    default (``exclusive``; else a config file may keep it, unread)."""
    return field(default=default, metadata={"help": help, "exclusive": exclusive})


class Options:
    """The base of an objective's settings class (a frozen dataclass; the module docstring)."""

    prefix: ClassVar[str]  # the flags' prefix: ``nft`` → --nft-…

    def problems(self) -> list[str]:
        """Its values' problems, each naming its flag (checked whichever objective a run trains)."""
        return []

    @classmethod
    def unread_with(cls, values: Mapping[str, Any]) -> tuple[str, ...]:
        """The general settings (config keys) these values make unread for an objective reading them."""
        return ()


@dataclass(frozen=True)
class OptionField:
    """One flag of a settings class: ``key`` its config key (``<prefix>_<name>``), ``name`` the class's field."""

    owner: type[Options]
    name: str
    key: str
    type: str
    default: Any
    help: str
    exclusive: bool


def option_fields(cls: type[Options]) -> tuple[OptionField, ...]:
    out = []
    for f in fields(cls):  # type: ignore[arg-type]  # every Options class is a dataclass
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        default = f.default if f.default is not MISSING else None
        out.append(
            OptionField(
                cls,
                f.name,
                f"{cls.prefix}_{f.name}",
                kind,
                default,
                f.metadata["help"],
                f.metadata.get("exclusive", False),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class OptionSet:
    """One instance of each settings class a run's config holds, found by its class (``of``); a class with no
    instance here reads as its defaults."""

    values: tuple[Options, ...] = ()

    def of(self, cls: type[SettingsT]) -> SettingsT:
        for value in self.values:
            if type(value) is cls:
                return value
        return cls()

    def merged(self, groups: Iterable[type[Options]], flat: Mapping[str, Any]) -> OptionSet:
        """Every class of ``groups`` (held ones kept, others at their defaults), then the config keys of ``flat``
        (``<prefix>_<name>`` → value) set on them; a key that is no group's field raises TypeError."""
        found = {type(value): value for value in self.values}
        for cls in groups:
            found.setdefault(cls, cls())
        left = dict(flat)
        for cls, value in list(found.items()):
            changes = {f.name: left.pop(f.key) for f in option_fields(cls) if f.key in left}
            if changes:
                found[cls] = replace(value, **changes)  # type: ignore[type-var]
        if left:
            raise TypeError(f"unexpected settings {', '.join(sorted(left))}")
        return OptionSet(tuple(found.values()))

    def flat(self) -> dict[str, Any]:
        """Config key → value of every held setting, in the classes' order."""
        return {f.key: getattr(value, f.name) for value in self.values for f in option_fields(type(value))}
