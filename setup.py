"""Ship the root-level configs/ and calibration/ folders inside the package as `quantizer.configs` and
`quantizer.calibration` (see DESIGN.md layout); which of their files ship is in pyproject.toml."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

DATA_ONLY = {"quantizer.calibration"}  # its build script stays in the repository


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        return [] if package in DATA_ONLY else super().find_package_modules(package, package_dir)


setup(
    packages=find_packages(include=["quantizer", "quantizer.*"])
    + ["quantizer.configs", "quantizer.calibration", "quantizer.small_model", "quantizer.small_model_v4",
       "quantizer.small_model_v4_moe64"],
    package_dir={"quantizer.configs": "configs", "quantizer.calibration": "calibration"},
    cmdclass={"build_py": BuildPy},
)
