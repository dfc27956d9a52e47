"""docs/architecture.md's "Add an architecture", followed in a copy of the project: a toy backbone's module, its
catalogue entry (with a variant), its YAML and its README row, and nothing else. Every catalogue-driven test then
runs on it (the contract for each shape, the CLI round trip, the config composition and size, MQAR training), with no
list elsewhere to edit."""

import re
import subprocess
import sys

from helpers import copy_tracked_files

TOY_MODULE = '''
"""A toy backbone for the recipe test: a bigram plus a causal running mean of the embeddings, in blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ltcx.errors import ConfigError
from ltcx.models.base import Backbone


@dataclass
class BigramConfig:
    """Shape of a Bigram."""

    vocab_size: int = 50304
    """output vocabulary; set by the CLI from the data's tokenizer."""
    n_embd: int = 8
    """width."""
    n_layer: int = 2
    """number of mixing blocks."""

    def __post_init__(self) -> None:
        if self.n_embd < 1:
            raise ConfigError(f"n_embd ({self.n_embd}) must be >= 1")


class Mix(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x, total, count):
        sums = total.unsqueeze(1) + x.cumsum(1)
        counts = count + torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return x + torch.tanh(self.proj(torch.cat([x, sums / counts[:, None]], -1))), sums[:, -1]


class Bigram(Backbone):
    """A toy backbone. State: per block the running sum of its inputs [B, C], and the count of tokens seen."""

    config_class = BigramConfig

    def __init__(self, **fields) -> None:
        super().__init__()
        config = self.config = self.config_class(**fields)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Mix(config.n_embd) for _ in range(config.n_layer))
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward_hidden(self, idx, state=None, with_state=True):
        x = self.wte(idx)
        count = 0 if state is None else state[1]
        totals = [torch.zeros_like(x[:, 0])] * len(self.blocks) if state is None else state[0]
        new_totals = []
        for block, total in zip(self.blocks, totals):
            x, total = block(x, total, count)
            new_totals.append(total)
        return x, (tuple(new_totals), count + idx.shape[1]) if with_state else None

    def output_head(self):
        return self.head

    def forward_flops_per_token(self, seq_len: int) -> float:
        return 2 * sum(p.numel() for name, p in self.named_parameters() if name.endswith("weight") and p.dim() == 2
                       and not name.startswith("wte"))

'''

TOY_YAML = """# A toy backbone (the recipe test's).
config: recipe.yaml
model.backbone:
  class_path: ltcx.models.bigram.Bigram
  init_args:
    n_embd: 32
    n_layer: 2
"""


def test_an_architecture_added_by_the_recipe_gets_every_catalogue_driven_test(tmp_path):
    project = copy_tracked_files(tmp_path / "project")
    (project / "ltcx/models/bigram.py").write_text(TOY_MODULE)
    (project / "configs/bigram.yaml").write_text(TOY_YAML)
    parameters = 50304 * 32 * 2 + 2 * (2 * 32 * 32 + 32)  # embedding, head, two Mix blocks
    catalog = project / "ltcx/models/catalog.py"
    entry = (f'    Architecture("bigram", "ltcx.models.bigram", "Bigram", "configs/bigram.yaml", dict(n_embd=8), '
             f'variants={{"deep": dict(n_layer=3)}}, yaml_parameters={parameters}),')
    text, count = re.subn(r"\n]\n\n_CATALOG", f"\n{entry}\n]\n\n_CATALOG", catalog.read_text())
    assert count == 1, "the catalogue's list of entries moved: update this test and docs/architecture.md"
    catalog.write_text(text)
    readme = project / "README.md"
    row = "| `configs/titans_lmm.yaml` |"
    text = readme.read_text()
    at = text.index("\n", text.index(row)) + 1
    readme.write_text(text[:at] + f"| `configs/bigram.yaml` | a toy | {parameters:,} |\n" + text[at:])

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-k", "bigram",
         "tests/test_contract.py", "tests/test_configs.py", "tests/test_recall.py"],
        cwd=project, capture_output=True, text=True, timeout=900,
        env={"PYTHONPATH": str(project), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert "failed" not in summary and passed >= 30, summary  # 2 shapes x 9 checks, the CLI, configs, MQAR, ...
    names = re.findall(r"::(\w+)\[[^\]]*bigram", done.stdout)
    assert {"test_contract", "test_cli_fit_resume_and_generate", "test_config_composes", "test_config_model_sizes",
            "test_every_architecture_trains_on_mqar_and_logs_recall_accuracy"} <= set(names), sorted(set(names))
