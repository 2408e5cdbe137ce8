"""Package discovery only (metadata lives in pyproject.toml); pure Python, no torch at build."""

from setuptools import find_packages, setup

setup(
    # csrc/ holds no Python: listed as packages so that setuptools ships its C++ sources
    # (declared as package data in pyproject.toml) without "package is absent" warnings.
    packages=[*find_packages(include=["mpnb", "mpnb.*"]), "mpnb._csrc", "mpnb._csrc.cpu"],
    package_dir={"mpnb._csrc": "csrc", "mpnb._csrc.cpu": "csrc/cpu"},
)
