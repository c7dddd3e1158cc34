"""The compiled part of the package: service/kernels/_kernels.c (project metadata is in pyproject.toml).

It is built against numpy's C API, and links numpy's random distributions (numpy/random/lib) so that its
draws are the very ones numpy's Generator makes from the same bit generator.
"""

from pathlib import Path

import numpy
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "service.kernels._kernels", ["service/kernels/_kernels.c"],
    include_dirs=[numpy.get_include()],
    library_dirs=[str(Path(numpy.__file__).parent / "random" / "lib")],
    libraries=["npyrandom", "m"],
    extra_compile_args=["-O3"],
)])
