"""Package list for setuptools.

The model zoo lives at the repository root in ``models/``; ``torchtitan_omni/models`` is a
symbolic link to it, so the zoo imports as ``torchtitan_omni.models`` both from a source
checkout and once installed (where it is copied), and nothing generic named ``models`` lands
in site-packages.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["torchtitan_omni", "torchtitan_omni.*"]))
