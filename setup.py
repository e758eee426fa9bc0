"""Builds aotfuse._C from the C core: C11 against Python.h only (no torch or CUDA headers)."""
import glob
import os

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))

core = Extension(
    "aotfuse._C",
    sources=sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.c"))),
    include_dirs=["include"],
    depends=glob.glob("include/aotfuse/*.h") + glob.glob("csrc/*.def"),
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    libraries=["dl", "m"],
)

setup(ext_modules=[core])
