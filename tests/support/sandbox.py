"""What the sandbox's test files share: its models, made once a run, and a sandbox folder
for each test that starts from a copy of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def sandbox_models_of(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Path:
    """The sandbox's models, made once a run by the sandbox's own maker (from the run's shared
    tiny model and draft, which are the sandbox's to the byte) by the first worker to ask, read
    by the rest; each test's sandbox starts from a copy, which `up` reuses as it reuses what is
    already there. A module's fixture:
    `pytest.fixture(scope="module", name="sandbox_models")(sandbox_models_of)`."""
    from kdctl.sandbox import make_models
    from tests.conftest import built_once, shared_dir

    def build(root: Path) -> None:
        for key in ("dsv3", "dsv3-draft"):
            shutil.copytree(models[key], root / "models" / models[key].name)
        make_models(root, None)

    return built_once(shared_dir(tmp_path_factory, "models"), "sandbox", build) / "models"


def sandbox_dir(tmp_path: Path, models: Path) -> Path:
    root = tmp_path / "sandbox"
    shutil.copytree(models, root / "models")
    return root
