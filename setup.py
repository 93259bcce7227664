"""Build step only (the metadata is in pyproject.toml): the folder harness/ installs as the import
package `qgather`, and the top-level golden/ corpus ships inside it as qgather/golden_data/, so that
an installed qgather can run `qgather golden --check`.

golden/ stays the single source of truth; setuptools' package-dir cannot map a directory outside
the package into it without listing every package by hand, hence the copy.
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
IMPORT_NAME = "qgather"
SOURCE_DIR = "harness"
PACKAGED_GOLDEN = "golden_data"  # qgather.paths.PACKAGED_GOLDEN


class BuildPyWithGolden(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install is a checkout: it reads golden/ in place
        target = os.path.join(self.build_lib, IMPORT_NAME, PACKAGED_GOLDEN)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "golden"), target)


setup(
    packages=[IMPORT_NAME, *(f"{IMPORT_NAME}.{p}" for p in find_packages(os.path.join(HERE, SOURCE_DIR)))],
    package_dir={IMPORT_NAME: SOURCE_DIR},
    cmdclass={"build_py": BuildPyWithGolden},
)
