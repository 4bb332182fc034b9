"""sparse-rl-mega: Sparse-RL (sparse KV rollouts + corrected loss) on Megatron-Core and SGLang.

CPU development venvs are built by ``tools/setup_env.sh`` from exact pins (``requirements/``);
``pip install -e .[gpu]`` adds the GPU-only pieces on a CUDA machine.
"""
from setuptools import find_packages, setup

setup(
    name="sparse-rl-mega",
    version="0.1.0",
    description="Sparse-RL: RL for LLM reasoning with compressed-KV rollouts and corrected loss",
    python_requires=">=3.11",  # what runs: 3.11 (the CPU venv's lock), 3.12 (the GPU check's image)
    packages=find_packages(include=["sparse_rl_mega", "sparse_rl_mega.*", "sglang_patches", "sglang_patches.*"]),
    install_requires=[
        "torch>=2.6",  # (the gpu extra: SGLang 0.5.23's torch; the CPU venv: 2.13.0+cpu, tools/setup_env.sh)
        "megatron-core==0.16.1",
        "sglang==0.5.23",
        "mlflow>=3.1",
        "transformers>=4.51",
        "math-verify>=0.7",
        "pyyaml",
        "xxhash",  # checkpoint digests (also an SGLang dependency)
        "packaging",  # the installed stack checked before a run (sparse_rl_mega/runtime/versions.py)
    ],
    extras_require={
        # Never installed on CPU: Transformer Engine breaks `import megatron.core` without CUDA. What
        # SGLang 0.5.23 requires (torch 2.14.1, CUDA-13 wheels) and Megatron-Core 0.16.1 was tested with
        # (Transformer Engine >= 2.9, < 2.12); checked before a run (sparse_rl_mega/runtime/versions.py)
        "gpu": ["torch==2.14.1", "transformer-engine[pytorch]>=2.9.0a0,<2.12", "sglang-kernel==0.4.10",
                "flashinfer-python==0.7.2", "cuda-python>=13"],
        "test": ["pytest", "pytest-xdist", "hypothesis"],
    },
    entry_points={
        # Loaded by SGLang's load_plugins() inside every engine process (scheduler included).
        "sglang.srt.plugins": ["sparse_rl_mega_kv = sglang_patches:register"],
        # The user-facing tools by name, beside their tools/ paths (which the docs use; a multi-node job
        # is `torchrun ... tools/launch.py`, whose ranks run that script).
        "console_scripts": [
            "sparse-rl-launch = sparse_rl_mega.cli.launch:main",
            "sparse-rl-evaluate = sparse_rl_mega.cli.evaluate:main",
            "sparse-rl-export-hf = sparse_rl_mega.cli.export_hf:main",
            "sparse-rl-prepare-data = sparse_rl_mega.cli.prepare_data:main",
            "sparse-rl-ablation = sparse_rl_mega.studies.ablation:main",
            "sparse-rl-chaos = sparse_rl_mega.studies.chaos:main",
        ],
    },
)
