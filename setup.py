"""Build step only (the metadata is in pyproject.toml): harness/ is the source root and
harness/qgather/ the import package, and the top-level golden/ corpus ships inside the package as
qgather/golden_data/, so that an installed qgather can run `qgather golden --check`.

golden/ stays the single source of truth (the checkout's design keeps it at the top level), hence
the copy at build time rather than a second tree.
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = "harness"
IMPORT_NAME = "qgather"
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
    packages=find_packages(os.path.join(HERE, SOURCE_ROOT), include=[IMPORT_NAME, f"{IMPORT_NAME}.*"]),
    package_dir={"": SOURCE_ROOT},
    cmdclass={"build_py": BuildPyWithGolden},
)
