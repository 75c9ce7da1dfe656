"""Builds fourbit's one compiled part, the CPU 4-bit linear (src/fourbit/kernels/csrc/).

Everything else about the package is in pyproject.toml. The extension is compiled by the
project's own set-up (envs/fourbit.post-deploy.sh: pip install --no-build-isolation -e .),
against the torch already installed, with no network. The source carries its own ISA
attributes (AVX2+FMA, checked at run time), so it is built without -march and the wheel
runs on any x86-64; -fopenmp makes at::parallel_for use torch's OpenMP threads (without it
the loop would run on one thread).
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "fourbit.kernels._int4_cpu",
            ["src/fourbit/kernels/csrc/int4_cpu.cpp"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
