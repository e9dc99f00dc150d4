"""Package list for setuptools: the repository's models/ folder installs as torchtitan_omni.models."""
from setuptools import find_packages, setup

framework = find_packages(include=["torchtitan_omni", "torchtitan_omni.*"])
zoo = ["torchtitan_omni." + p for p in find_packages(include=["models", "models.*"])]
setup(packages=framework + zoo, package_dir={"torchtitan_omni.models": "models"})
