"""megatron-slim: long- and variable-length-context training plugins for Megatron-LM.

NVIDIA apex is deliberately absent: the PyPI package called ``apex`` is an unrelated web
framework. apex comes from NGC containers or a source build (see README); megatron-slim
runs without it.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-slim",
    version="0.1.0",
    description="SlimPipe, Zeppelin, SlimPack and DynMo for Megatron-LM",
    packages=find_packages(include=["megatron_slim", "megatron_slim.*"]),
    package_data={"megatron_slim": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.14,<0.20",
        "pyyaml>=6",
        "numpy",
        "matplotlib>=3.7",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
        "test": ["pytest>=8", "hypothesis>=6"],
    },
    entry_points={"console_scripts": ["megatron-slim=megatron_slim.cli:main"]},
)
