"""Build script for dflash-kernels.

`pip install --no-build-isolation -e .` builds the compiled ops against the installed torch;
a plain (isolated) `pip install -e .` installs the pure-Python package.
"""
from setuptools import find_packages, setup

setup(
    name="dflash-kernels",
    version="0.1.0",
    description="Triton/CUDA kernels and a CUDA-graph runtime for DFlash block-diffusion speculative decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dflash_kernels", "dflash_kernels.*", "dflash", "dflash.*"]),
    package_data={"dflash_kernels": ["README.md"], "dflash": ["assets/**/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",
        "numpy",
        "transformers>=5.17",
        "safetensors",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark"],
        "demo": ["gguf", "accelerate"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["dflash = dflash.cli:main"]},
)
