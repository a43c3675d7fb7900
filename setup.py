"""The optional C kernel of mechdiag.displacement; everything else is in pyproject.toml. Without a C compiler
the build skips it (optional=True) and displacement runs the same arithmetic in torch."""

import sys

from setuptools import Extension, setup

args = [] if sys.platform == "win32" else ["-O3", "-fno-math-errno", "-Wno-psabi"]
setup(ext_modules=[Extension("mechdiag._diffkernel", ["mechdiag/_diffkernel.c"], extra_compile_args=args,
                             optional=True)])
