"""Builds fourbit's one compiled part, the CPU 4-bit linear (src/fourbit/kernels/csrc/).

Everything else about the package is in pyproject.toml. The extension is compiled by the
project's own set-up (envs/fourbit.post-deploy.sh: pip install --no-build-isolation -e .),
against the torch already installed, with no network. The source carries its own ISA
attributes (AVX2+FMA, checked at run time), so it is built without -march and runs on any
x86-64; -fopenmp makes at::parallel_for use torch's OpenMP threads (without it the loop
would run on one thread).

Without a C++ compiler (or if the compile fails) the package installs without the
extension and the plugin runs tinygemm instead, saying so (fourbit.kernels.int4_cpu).
"""

import os
import shutil
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

compiler = os.environ.get("CXX", "c++")
if shutil.which(compiler) is None:
    print(f"fourbit: no C++ compiler ({compiler}); the int4 CPU kernel is not built",
          file=sys.stderr)
    ext_modules = []
else:
    ext_modules = [
        CppExtension(
            "fourbit.kernels._int4_cpu",
            ["src/fourbit/kernels/csrc/int4_cpu.cpp"],
            depends=["src/fourbit/kernels/csrc/multirow.inc"],  # included by int4_cpu.cpp
            # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS (sysconfig), which
            # setuptools puts first: defined signed overflow keeps GCC from simplifying the
            # kernel's int64 index arithmetic, and cost its decode 8-20% (docs/engines.md)
            extra_compile_args=["-O3", "-fno-wrapv", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,  # a failed compile warns and installs the rest
        )
    ]

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExtension})
