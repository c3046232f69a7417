"""ampinit's build.  Metadata lives in pyproject.toml.

This build is pure Python: the ops in ``ampinit/ops.py`` run on PyTorch's own foreach/amp
kernels.  ``get_extensions`` is where the compiled C++/CUDA kernels of ``csrc/`` will be
declared; until then it returns none, and ``ampinit.ops.backend()`` reports the fallback.
"""

from setuptools import setup


def get_extensions():
    return []


setup(ext_modules=get_extensions())
