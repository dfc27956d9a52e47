"""ltcx's GPT in GPT-2's layout (transformers' ``GPT2LMHeadModel``) and back, as plain tensors (no transformers).

The maps are exact: GQA's key/value heads repeated into multi-head attention (query head h reads KV head
h // (n_head / n_kv_head)), absent biases written as zeros, the tied embedding, GPT-2's ``Conv1D`` weights as the
transposes of ``nn.Linear``'s. Only ``GPT`` itself maps (not LTC, GTA or the recurrent models), and the vocabulary
may be cut to the tokenizer's ids (the padding rows carry no token).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ltcx.errors import LtcxError

__all__ = ["check_gpt2_layout", "gpt2_config", "gpt2_state_dict", "gpt_from_gpt2_folder"]

# GPT-2's activation names and the GELU each is (gelu_new computes the tanh form in another order).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def check_gpt2_layout(backbone) -> None:
    """One line unless ``backbone`` is a ``GPT`` (exactly: subclasses change the attention)."""
    from ltcx.models.registry import class_path

    if class_path(type(backbone)) != "ltcx.models.gpt.GPT":
        raise LtcxError(f"--format gpt2 takes ltcx's GPT only ({type(backbone).__name__} has no GPT-2 equivalent): "
                        "use --format hf, which loads every ltcx architecture in transformers")
    if backbone.config.position != "learned":
        raise LtcxError(f"--format gpt2 takes learned positions only (this GPT has position "
                        f"'{backbone.config.position}', which GPT-2's layout has no place for): use --format hf")


def gpt2_config(backbone, vocab_size: int) -> dict[str, Any]:
    """``GPT2Config`` arguments of ``backbone`` with a vocabulary of ``vocab_size`` rows (<= the model's)."""
    c = backbone.config
    activation = "gelu_pytorch_tanh" if c.activation == "gelu_tanh" else "gelu"
    return dict(vocab_size=vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                n_inner=c.ffn_hidden, activation_function=activation,
                resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=1e-5,
                tie_word_embeddings=True, scale_attn_weights=True)


def gpt2_state_dict(backbone, vocab_size: int) -> dict[str, torch.Tensor]:
    """``backbone``'s weights under GPT-2's names and layout (``lm_head.weight`` omitted: tied to ``wte``)."""
    c = backbone.config
    heads, kv_heads, dim = c.n_head, c.n_kv_head, c.head_dim
    out = {"transformer.wte.weight": backbone.wte.weight[:vocab_size], "transformer.wpe.weight": backbone.wpe.weight}

    def linear(prefix: str, layer: torch.nn.Linear) -> None:  # Conv1D holds the transposed matrix
        out[f"{prefix}.weight"] = layer.weight.t()
        out[f"{prefix}.bias"] = layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)

    def norm(prefix: str, layer: torch.nn.LayerNorm) -> None:
        out[f"{prefix}.weight"] = layer.weight
        out[f"{prefix}.bias"] = layer.bias if layer.bias is not None else torch.zeros_like(layer.weight)

    for i, block in enumerate(backbone.blocks):
        p = f"transformer.h.{i}"
        attn = block.attn
        kv_w = attn.kv_proj.weight.view(2, kv_heads, dim, c.n_embd).repeat_interleave(heads // kv_heads, dim=1)
        kv_b = (attn.kv_proj.bias if attn.kv_proj.bias is not None else attn.kv_proj.weight.new_zeros(
            2 * kv_heads * dim)).view(2, kv_heads, dim).repeat_interleave(heads // kv_heads, dim=1)
        q_b = attn.q_proj.bias if attn.q_proj.bias is not None else attn.q_proj.weight.new_zeros(heads * dim)
        weight = torch.cat([attn.q_proj.weight, kv_w.reshape(2 * heads * dim, c.n_embd)])  # [3 C, C]
        out[f"{p}.attn.c_attn.weight"] = weight.t()
        out[f"{p}.attn.c_attn.bias"] = torch.cat([q_b, kv_b.reshape(-1)])
        linear(f"{p}.attn.c_proj", attn.c_proj)
        norm(f"{p}.ln_1", block.ln_1)
        norm(f"{p}.ln_2", block.ln_2)
        linear(f"{p}.mlp.c_fc", block.mlp.c_fc)
        linear(f"{p}.mlp.c_proj", block.mlp.c_proj)
    norm("transformer.ln_f", backbone.ln_f)
    return {name: tensor.detach().contiguous().clone() for name, tensor in out.items()}


def gpt_from_gpt2_folder(folder: str | Path, gpt_class: type):
    """An ltcx ``GPT`` (multi-head, with biases) holding the weights of a GPT-2-layout folder (``config.json`` with
    ``model_type: gpt2`` and ``model.safetensors``), read as data: nanoGPT's ``from_pretrained('gpt2')`` habit for a
    folder on this machine. Logits equal the folder's ``GPT2LMHeadModel``'s. ``gpt_class``: ``ltcx.models.gpt.GPT``
    (passed in: that module imports this one)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    for path in (config_file, weights_file):
        if not path.is_file():
            raise LtcxError(f"'{folder}' has no {path.name}: give a folder written by GPT2LMHeadModel.save_pretrained "
                            "(one model.safetensors file)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise LtcxError(f"'{config_file}' is not JSON ({error})") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise LtcxError(f"'{config_file}' is not a GPT-2 config (model_type {config.get('model_type')!r}): "
                        "GPT.from_hf reads GPT-2-layout folders only")
    activation = _ACTIVATIONS.get(config.get("activation_function", "gelu_new"))
    unsupported = [key for key, ok in (("activation_function", activation is not None),
                                       ("scale_attn_by_inverse_layer_idx",
                                        not config.get("scale_attn_by_inverse_layer_idx")),
                                       ("scale_attn_weights", config.get("scale_attn_weights", True)),
                                       ("add_cross_attention", not config.get("add_cross_attention")))
                   if not ok]
    if unsupported:
        raise LtcxError(f"'{config_file}' sets {', '.join(unsupported)} to what ltcx's GPT does not compute: only "
                        "GPT-2's own attention and GELU map")
    if abs(float(config.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        raise LtcxError(f"'{config_file}' has layer_norm_epsilon {config['layer_norm_epsilon']}; ltcx's GPT uses 1e-5")
    n_embd, n_layer, n_head = config["n_embd"], config["n_layer"], config["n_head"]
    model = gpt_class(block_size=config["n_positions"], vocab_size=config["vocab_size"], n_layer=n_layer, n_head=n_head,
                n_kv_head=n_head, n_embd=n_embd, bias=True, mlp_hidden=config.get("n_inner") or None,
                activation=activation)
    weights = {name.removeprefix("transformer."): tensor for name, tensor in load_file(str(weights_file)).items()}
    try:
        state = _ltcx_names(weights, n_layer, n_embd)
    except KeyError as error:
        raise LtcxError(f"'{weights_file}' lacks weight {error} of a GPT-2 of its config.json") from None
    try:
        model.load_state_dict({k: v.float().contiguous() for k, v in state.items()})
    except RuntimeError as error:
        raise LtcxError(f"'{weights_file}' does not fit its config.json ({str(error).splitlines()[0]})") from None
    return model.eval()


def _ltcx_names(weights: dict[str, torch.Tensor], n_layer: int, n_embd: int) -> dict[str, torch.Tensor]:
    """GPT-2's weights (``transformer.`` dropped) under the names and layout of ltcx's ``GPT``."""
    state: dict[str, torch.Tensor] = {"wte.weight": weights["wte.weight"], "wpe.weight": weights["wpe.weight"],
                                      "ln_f.weight": weights["ln_f.weight"], "ln_f.bias": weights["ln_f.bias"]}
    for i in range(n_layer):
        p, q = f"h.{i}", f"blocks.{i}"
        w, b = weights[f"{p}.attn.c_attn.weight"].t(), weights[f"{p}.attn.c_attn.bias"]  # [3 C, C], [3 C]
        state.update({f"{q}.attn.q_proj.weight": w[:n_embd], f"{q}.attn.q_proj.bias": b[:n_embd],
                      f"{q}.attn.kv_proj.weight": w[n_embd:], f"{q}.attn.kv_proj.bias": b[n_embd:]})
        for ours, theirs in (("attn.c_proj", "attn.c_proj"), ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
            state[f"{q}.{ours}.weight"] = weights[f"{p}.{theirs}.weight"].t()
            state[f"{q}.{ours}.bias"] = weights[f"{p}.{theirs}.bias"]
        for ln in ("ln_1", "ln_2"):
            state[f"{q}.{ln}.weight"], state[f"{q}.{ln}.bias"] = weights[f"{p}.{ln}.weight"], weights[f"{p}.{ln}.bias"]
    state["lm_head.weight"] = state["wte.weight"]
    return state
