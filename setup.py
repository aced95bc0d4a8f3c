"""Package list only; everything else is in pyproject.toml.

kernels/ sits at the repository root (DESIGN.md) and ships inside the wheel as atlas.kernels;
pyproject's automatic discovery cannot map a top-level folder into the package, so it is
listed here.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["atlas", "atlas.*"]), "atlas.kernels"],
    package_dir={"atlas.kernels": "kernels"},
)
