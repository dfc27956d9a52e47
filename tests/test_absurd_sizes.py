"""Files whose config asks for an absurd model (100000 layers, a width of 10**7, a vocabulary of 10**9) or whose
counts are not counts: refused in one line before anything is allocated, by every entry point that builds a model
from a file; the model a file's config describes is built on the meta device and compared with its weights first."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, assert_mentions, lean_fit_args, one_error_line, write_corpus
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.persist import DIGEST_KEY, atomic_save, export_model

ABSURD = [("n_layer", 100000), ("n_embd", 10**7), ("vocab_size", 10**9), ("vocab_size", 10**18)]
BYTES = ["--data.tokenizer", "bytes"]  # the small checkpoint's tokenizer
OTHER_CONFIG = ("another version of ltcx or another config", "the version that wrote it", "start a new run")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A checkpoint saved by `ltcx fit` (one step of the tiny GPT, bytes tokenizer), its export and its corpus."""
    root = tmp_path_factory.mktemp("files")
    data = write_corpus(root / "corpus", 60, 10)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["ltcx"])
        main(lean_fit_args(root, data, *BYTES, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(root)))
    checkpoint = root / "checkpoints/gpt/version_0/last.ckpt"
    return checkpoint, export_model(checkpoint, root / "exported", model_class=LanguageModel), data


def resume_args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    """A tiny fit's arguments without the typed backbone flags: a resumed run builds the checkpoint's backbone."""
    args = lean_fit_args(tmp_path, data, *BYTES, *extra)
    typed = {i for i, arg in enumerate(args) if arg.startswith("--model.backbone.")}
    return [arg for i, arg in enumerate(args) if i not in typed and i - 1 not in typed]


def edited_checkpoint(good: Path, path: Path, change) -> Path:
    """``good`` with ``change(checkpoint)`` applied and its digest recomputed (``atomic_save`` writes it): a file
    that is not damaged, only inconsistent."""
    checkpoint = torch.load(good, weights_only=True)
    del checkpoint[DIGEST_KEY]
    change(checkpoint)
    atomic_save(checkpoint, path)
    return path


def edited_export(good: Path, out: Path, change) -> Path:
    """A copy of the export ``good`` with ``change(config)`` applied to its config.json (its weights and their
    SHA-256 unchanged)."""
    shutil.copytree(good, out)
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def absurd_file(files, tmp_path: Path, kind: str, setting: str, value: int) -> tuple[Path, str]:
    """A checkpoint or an export of the small model whose backbone_config says ``setting: value``, and its name in
    an error line."""
    if kind == "checkpoint":
        path = edited_checkpoint(files[0], tmp_path / "absurd.ckpt",
                                 lambda c: c["ltcx"]["backbone_config"].update({setting: value}))
        return path, f"checkpoint '{path}'"
    path = edited_export(files[1], tmp_path / "absurd", lambda c: c["backbone_config"].update({setting: value}))
    return path, f"exported model '{path}'"


def assert_too_large(line: str, source: str) -> None:
    assert line.startswith(source), line
    assert_mentions(line, "does not fit", "backbone_config builds more weights than the file holds", " values",
                    *OTHER_CONFIG)


@pytest.mark.parametrize("setting,value", ABSURD)
@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_absurd_model_size_is_refused_before_building(tmp_path, files, capsys, nothing_built, kind, setting, value):
    path, source = absurd_file(files, tmp_path, kind, setting, value)
    line = one_error_line(["generate", "--ckpt_path", str(path), "--max_new_tokens", "2"], capsys)
    assert_too_large(line.removeprefix("ltcx: error: "), source)
    assert nothing_built == []


ENTRIES = ["fit", "validate", "test", "predict", "export", "evaluate", "lm-eval", "load_from_checkpoint",
           "from_pretrained"]


@pytest.mark.parametrize("kind,entry", [("checkpoint", e) for e in ENTRIES if e != "from_pretrained"]
                         + [("export", e) for e in ("evaluate", "lm-eval", "load_from_checkpoint", "from_pretrained")])
def test_every_entry_point_refuses_an_absurd_file(tmp_path, fit_env, files, capsys, nothing_built, kind, entry):
    path, source = absurd_file(files, tmp_path, kind, "n_layer", 100000)
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    if entry in ("load_from_checkpoint", "from_pretrained"):
        with pytest.raises(LtcxError) as error:
            getattr(LanguageModel, entry)(path)
        assert_too_large(str(error.value), source)
    else:
        data = files[2]
        lightning = [*resume_args(tmp_path, data)[1:], "--ckpt_path", str(path)]
        args = {
            "fit": ["fit", *lightning, "--trainer.max_steps", "2"],
            "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
            "evaluate": ["evaluate", "--ckpt_path", str(path), "--data.path", str(data), "--out",
                         str(tmp_path / "evaluation")],
            "lm-eval": ["lm-eval", "--ckpt_path", str(path), "--tasks", "hellaswag", "--out", str(tmp_path / "lm")],
        }.get(entry, [entry, *lightning])
        assert_too_large(one_error_line(args, capsys).removeprefix("ltcx: error: "), source)
    assert nothing_built == []
    assert {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"} == before


def test_the_small_checkpoint_resumes(tmp_path, fit_env, files):
    """The file the tests edit resumes as it is (so that their refusals are the edits')."""
    main(resume_args(tmp_path, files[2], "--trainer.max_steps", "2", "--ckpt_path", str(files[0])))
    assert torch.load(tmp_path / "checkpoints/gpt/version_0/last.ckpt", weights_only=True)["global_step"] == 2


def test_weights_of_the_file_named_by_the_check_before_building(tmp_path, files, capsys, nothing_built):
    """A config a little off (2 layers, the file holds 1) is named weight by weight, before the model is built."""
    path = edited_checkpoint(files[0], tmp_path / "two.ckpt",
                             lambda c: c["ltcx"]["backbone_config"].update(n_layer=2))
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert_mentions(line, f"checkpoint '{path}'", "does not fit", "backbone.blocks.1.ln_1.weight [32]",
                    "not in the file", "and 6 more", *OTHER_CONFIG)
    assert nothing_built == []


def test_a_model_larger_than_memory_is_refused_before_building(tmp_path, files, capsys, nothing_built, monkeypatch):
    """Weights of the right names and shapes that hold almost no bytes (each tensor a view of one number): the
    model they describe, 40 TB in float32, is refused by its size."""
    from ltcx.models.gpt import GPT

    config = {**torch.load(files[0], weights_only=True)["ltcx"]["backbone_config"], "vocab_size": 10**9,
              "n_embd": 10**4}
    with torch.device("meta"):
        shapes = {f"backbone.{k}": v.shape for k, v in GPT(**config).state_dict().items()}
    checkpoint = torch.load(files[0], weights_only=True)
    del checkpoint[DIGEST_KEY]  # hashing these views would make them whole
    checkpoint["state_dict"] = {k: torch.zeros(()).expand(shape) for k, shape in shapes.items()}
    checkpoint["ltcx"]["backbone_config"] = config
    path = tmp_path / "views.ckpt"
    torch.save(checkpoint, path)
    monkeypatch.setattr("ltcx.persist.file_fits.memory_limit", lambda: 64 * 2**30)
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    count = sum(math.prod(s) for k, s in shapes.items() if k != "backbone.lm_head.weight")  # tied to the embedding
    assert_mentions(line, f"checkpoint '{path}'", f"{count:,} parameters", f"{count * 4 / 2**30:,.1f} GiB in float32",
                    "64.0 GiB of memory here", "a machine with more memory")
    assert nothing_built == []


LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (10 * 2**30, 10 * 2**30))
from ltcx.cli import main
main(sys.argv[1:])
"""


def test_absurd_width_under_a_memory_limit_is_one_line(tmp_path, files):
    """As a user meets it: `ltcx generate` of an export asking for a width of 10**7 (12.8 GB of embedding) under a
    10 GiB address-space limit says so in one line and exits 2, instead of an allocator traceback."""
    path, source = absurd_file(files, tmp_path, "export", "n_embd", 10**7)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", LIMITED, "generate", "--ckpt_path", str(path)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert_too_large(line.removeprefix("ltcx: error: "), source)


# -- counts that are not counts --------------------------------------------------------------------------------

EXPORT_COUNTS = [
    ("train_block_size", "64", 1), ("train_block_size", -64, 1), ("train_block_size", 64.0, 1),
    ("train_block_size", True, 1), ("global_step", "3", 0), ("global_step", -1, 0), ("tokens_seen", "x", 0),
    ("tokens_seen", -5, 0),
]


@pytest.mark.parametrize("key,value,least", EXPORT_COUNTS)
def test_an_export_count_that_is_no_count_is_named(tmp_path, files, capsys, key, value, least):
    out = edited_export(files[1], tmp_path / "exported", lambda c: c.update({key: value}))
    facts = (f"exported model '{out}'", f"config.json's {key} {value!r}", f"not an integer >= {least}",
             "fix it in the file", "use another one")
    line = one_error_line(["evaluate", "--ckpt_path", str(out), "--data.path", str(files[2]), "--max_len", "2x",
                           "--out", str(tmp_path / "evaluation")], capsys)
    assert_mentions(line, *facts)
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert_mentions(str(error.value), *facts)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "evaluation").exists()


def test_an_export_digest_that_is_no_digest_is_named(tmp_path, files, capsys):
    out = edited_export(files[1], tmp_path / "exported", lambda c: c.update(weights_sha256=5))
    line = one_error_line(["generate", "--ckpt_path", str(out)], capsys)
    assert_mentions(line, f"exported model '{out}'", "config.json's weights_sha256 5", "SHA-256 (64 hex digits)",
                    "export it again from its checkpoint")


CHECKPOINT_COUNTS = [
    ("datamodule_hyper_parameters.block_size", "64", 1), ("datamodule_hyper_parameters.block_size", -64, 1),
    ("global_step", "3", 0), ("ltcx.tokens_seen", -1, 0), ("ltcx.tokens_seen", 1.5, 0),
]


@pytest.mark.parametrize("key,value,least", CHECKPOINT_COUNTS)
@pytest.mark.parametrize("entry", ["evaluate", "fit"])
def test_a_checkpoint_count_that_is_no_count_is_named(tmp_path, fit_env, files, capsys, entry, key, value, least):
    where, _, name = key.rpartition(".")

    def change(checkpoint):
        (checkpoint[where] if where else checkpoint)[name] = value

    path = edited_checkpoint(files[0], tmp_path / "counts.ckpt", change)
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    args = {
        "evaluate": ["evaluate", "--ckpt_path", str(path), "--data.path", str(files[2]), "--max_len", "2x",
                     "--out", str(tmp_path / "evaluation")],
        "fit": resume_args(tmp_path, files[2], "--trainer.max_steps", "5", "--ckpt_path", str(path)),
    }[entry]
    assert_mentions(one_error_line(args, capsys), f"checkpoint '{path}'", f"{key} {value!r}", f"integer >= {least}",
                    "fix it in the file", "use another one")
    assert {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"} == before
