"""Which CANN a torch-npu wheel is built for: torch-npu's pip version is not the Ascend product version
(``2.7.1.post8`` is TorchNPU 26.1.0, built against CANN 9.1.0), and a wheel on another CANN fails at import or,
worse, at the first kernel. ``env-check`` names the CANN the installed wheel needs and warns when the installed
CANN is another.

Source: the torch-npu compatibility table, Ascend/pytorch ``COMPATIBILITY.md`` (gitcode.com/Ascend/pytorch, mirrored
at github.com/Ascend/pytorch), as summarised in shared/reference/methods-2026.md §7.4 (late 2026) and
shared/reference/torch-npu-api.md §0. Wheels newer than the table (2.13, 2.14: "instant adaptation" builds from
master snapshots) are reported as not in it, never guessed.
"""

from __future__ import annotations

import re

# Ascend product release → (the CANN it ships with, its torch-npu wheels). "9.1.x": any 9.1 patch release.
RELEASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "26.1.1": ("9.1.x", ("2.12.0.post2", "2.11.0.post2", "2.10.0.post6", "2.9.0.post8", "2.7.1.post10")),
    "26.1.0": ("9.1.0", ("2.12.0", "2.11.0", "2.10.0.post4", "2.9.0.post6", "2.7.1.post8")),
    # 2.10.0.post2 is torch-npu-api.md §0's (the 26.0.0 README example) beside methods-2026.md's 2.10.0
    "26.0.0": ("9.0.0", ("2.10.0", "2.10.0.post2", "2.9.0.post2", "2.8.0.post4", "2.7.1.post4")),
    "7.3.0": ("8.5.0", ("2.9.0", "2.8.0.post2", "2.7.1.post2", "2.6.0.post5")),
    "7.2.0": ("8.3.RC1", ("2.8.0", "2.7.1", "2.6.0.post3")),
}
RECOMMENDED = "torch 2.12.0 + torch-npu 2.12.0 + CANN 9.1.0 (Python 3.10-3.14)"
TABLE_SOURCE = "Ascend/pytorch COMPATIBILITY.md"


def normalise_wheel(version: str) -> str:
    """``2.7.1post8`` (MindSpeed's spelling), ``2.7.1.post8+cpu`` → ``2.7.1.post8``."""
    version = version.strip().split("+", 1)[0]
    return re.sub(r"(?<=\d)\.?post(\d+)$", r".post\1", version)


def release_of(torch_npu_version: str) -> tuple[str, str] | None:
    """(Ascend product release, the CANN it needs) of a torch-npu wheel; None when the table does not list it."""
    wheel = normalise_wheel(torch_npu_version)
    for product, (cann, wheels) in RELEASES.items():
        if wheel in wheels:
            return product, cann
    return None


def cann_matches(required: str, installed: str) -> bool:
    """Whether the ``installed`` CANN version is the ``required`` one (``9.1.x``: any 9.1 release; an exact one also
    accepts its builds, ``9.1.0.1`` or ``8.3.RC1.alpha001``)."""
    installed = installed.strip()
    if required.endswith(".x"):
        return installed.startswith(required[:-1])
    return installed == required or installed.startswith(required + ".")


def cann_note(torch_npu_version: str | None, cann_version: str | None) -> tuple[str, bool] | None:
    """(one sentence about the installed torch-npu's CANN, whether it is a mismatch to warn about); None without a
    torch-npu."""
    if not torch_npu_version:
        return None
    found = release_of(torch_npu_version)
    if found is None:
        return (
            f"torch-npu {torch_npu_version} is not in {TABLE_SOURCE} as fluxgrpo knows it (2.6-2.12): check the CANN "
            f"it needs there; the recommended set is {RECOMMENDED}",
            False,
        )
    product, required = found
    needs = f"torch-npu {torch_npu_version} is TorchNPU {product} and needs CANN {required} ({TABLE_SOURCE})"
    if cann_version is None:
        return f"{needs}; no CANN found: install it and source its set_env.sh", True
    if cann_matches(required, cann_version):
        return f"{needs}; CANN {cann_version} is installed", False
    return (
        f"{needs}, but CANN {cann_version} is installed: install CANN {required}, or the torch-npu of CANN "
        f"{cann_version}'s release ({', '.join(_wheels_for(cann_version)) or 'see the table'})",
        True,
    )


def _wheels_for(cann_version: str) -> list[str]:
    return [wheel for cann, wheels in RELEASES.values() if cann_matches(cann, cann_version) for wheel in wheels]
