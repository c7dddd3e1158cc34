"""The package's layout and its compiled part (project metadata is in pyproject.toml).

The installed import package is `replayd` alone: the repository's replayd/ folder, whose links `server`,
`client` and `wire` are its service/, client/ and proto/ folders (what both sides share). The sampling
kernels (service/kernels/_kernels.c) are built against numpy's C API and link
numpy's random distributions (numpy/random/lib), so that their draws are the very ones numpy's Generator
makes from the same bit generator.
"""

from pathlib import Path

import numpy
from setuptools import Extension, find_packages, setup

setup(
    packages=find_packages(include=["replayd", "replayd.*"]),
    ext_modules=[Extension(
        "replayd.server.kernels._kernels", ["service/kernels/_kernels.c"],
        include_dirs=[numpy.get_include()],
        library_dirs=[str(Path(numpy.__file__).parent / "random" / "lib")],
        libraries=["npyrandom", "m"],
        extra_compile_args=["-O3"],
    )],
)
