"""Build step only (the metadata is in pyproject.toml): ship the top-level golden/ corpus inside
the package as harness/golden_data/, so that an installed qgather can run `qgather golden --check`.

golden/ stays the single source of truth; setuptools' package-dir cannot map a directory outside
the package into it without listing every package by hand, hence the copy.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGED_GOLDEN = "golden_data"  # harness.paths.PACKAGED_GOLDEN


class BuildPyWithGolden(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install is a checkout: it reads golden/ in place
        target = os.path.join(self.build_lib, "harness", PACKAGED_GOLDEN)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "golden"), target)


setup(cmdclass={"build_py": BuildPyWithGolden})
