"""Package discovery only (metadata lives in pyproject.toml); pure Python, no torch at build."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["mpnb", "mpnb.*"]), "mpnb._csrc"],
    package_dir={"mpnb._csrc": "csrc"},
)
