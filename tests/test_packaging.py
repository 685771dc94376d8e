"""pyproject.toml as the build backend reads it: what a fresh `pip install` builds from."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_pyproject_uses_no_field_setuptools_is_removing(monkeypatch):
    """setuptools deprecated `license = { text = ... }` with a date (2027-02-18) after which
    builds fail; scripts/install.sh builds with the newest setuptools (pip's build isolation)."""
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    from setuptools.warnings import SetuptoolsDeprecationWarning

    monkeypatch.chdir(REPO)  # the readme and the packages are found from the project's root
    with warnings.catch_warnings():
        warnings.simplefilter("error", SetuptoolsDeprecationWarning)
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert dist.get_name() == "lucidlm"
