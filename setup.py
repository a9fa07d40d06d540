"""Ship the root-level configs/ folder inside the package as `quantizer.configs` (see DESIGN.md layout)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["quantizer", "quantizer.*"]) + ["quantizer.configs"],
    package_dir={"quantizer.configs": "configs"},
)
