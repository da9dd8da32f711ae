"""Only here because cffi's API-mode build hooks in through setup(cffi_modules=...); metadata lives in pyproject.toml."""
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
