"""transformers integration: every catalogue architecture as a ``PreTrainedModel`` + ``GenerationMixin``, without
remote code.

Importing this module registers ``LtcxConfig`` (``model_type: ltcx``) with ``AutoConfig`` and ``LtcxForCausalLM``
with ``AutoModelForCausalLM``, so that ``import ltcx.hf; AutoModelForCausalLM.from_pretrained(folder)`` loads a
folder written by ``ltcx export --format hf``. The code is this installed package: ``config.json`` names a catalogue
architecture (``gpt``, ``titans_mal``, ...), resolved through ltcx's registry, never a class path or a module read
from the file, and a config asking for code of its own (``auto_map``) is refused before anything is imported. A folder
is read as ``ltcx generate`` reads an export: its weights' names and shapes (the safetensors header) are compared with
the model its config describes, and that model's size with the memory here, before anything is built
(``check_backbone_fits``); once loaded, every tensor the model needs came from the file and is finite.

Generation runs through the backbone's own state (a KV cache, GTA's latent cache, the xLSTM's and Titans'
constant-size states): ``LtcxCache`` is a ``transformers`` ``Cache`` that holds that state and its length, and beam
search reorders it with the backbone's ``reorder_cache``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ltcx.errors import LtcxError
from ltcx.models import catalog
from ltcx.models.inference_cache import keeping_derived
from ltcx.models.registry import class_path, resolve_backbone
from ltcx.persist.file_fits import check_backbone_fits, check_setting_types, current_names, unknown_settings
from ltcx.persist.finite import check_finite

__all__ = ["LtcxCache", "LtcxConfig", "LtcxForCausalLM", "MODEL_TYPE", "hf_model"]

MODEL_TYPE = "ltcx"
# Keys of a config.json that would make transformers (or a reader) import code named by the file.
_CODE_KEYS = ("auto_map", "backbone_class", "class_path", "custom_pipelines")


class LtcxConfig(PretrainedConfig):
    """``architecture``: a catalogue name (``ltcx.models.catalog``); ``backbone_config``: its constructor arguments
    (the backbone's ``config_dict()``); ``tokenizer_vocab_size``: the ids the tokenizer produces, when the model's
    vocabulary is padded past them (generation never produces the padding ids, as in ``ltcx generate``)."""

    model_type = MODEL_TYPE

    def __init__(self, architecture: str | None = None, backbone_config: dict | None = None,
                 tokenizer_vocab_size: int | None = None, use_cache: bool = True, **kwargs: Any) -> None:
        for key in _CODE_KEYS:
            if kwargs.get(key) is not None:
                raise LtcxError(f"this ltcx config names code of its own ({key}), which ltcx never runs: an ltcx "
                                "model's code is the installed ltcx package; remove the key or re-export the model")
        if architecture is not None:
            _check_backbone_config(backbone_config)
            entry = _entry(architecture, backbone_config or {})
            # a config.json written before a backbone field was renamed: this version's names
            stored = {"backbone_class": entry.class_path, "backbone_config": backbone_config or {}}
            backbone_config = current_names("config.json", stored)["backbone_config"]
            _check_settings(entry, backbone_config)
        self.architecture = architecture
        self.backbone_config = dict(backbone_config or {})
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.use_cache = use_cache
        if "vocab_size" in self.backbone_config:
            kwargs.setdefault("vocab_size", self.backbone_config["vocab_size"])
        super().__init__(**kwargs)


def _check_backbone_config(backbone_config: Any) -> None:
    """One line for a ``backbone_config`` that is not a mapping or names code (a class path, an ``auto_map``): its
    settings are data for a catalogue class, never a way to pick one."""
    if backbone_config is not None and not isinstance(backbone_config, dict):
        raise LtcxError(f"config.json has backbone_config {backbone_config!r:.80}, not a mapping of settings: "
                        "re-export the model")
    for key in _CODE_KEYS:
        if key in (backbone_config or {}):
            raise LtcxError(f"config.json has backbone_config.{key}, which names code: ltcx never runs code a file "
                            "names (an ltcx model's code is the installed ltcx package); remove the key or re-export "
                            "the model")


def _check_settings(entry: catalog.Architecture, backbone_config: dict) -> None:
    """One line for a setting (in this version's names) that ``entry``'s class does not take or of another type than
    it annotates, instead of its constructor's TypeError."""
    backbone_class = resolve_backbone(entry.class_path)
    unknown = unknown_settings(backbone_config, backbone_class)
    if unknown:
        raise LtcxError(f"config.json has backbone_config {', '.join(unknown)}, which this version's "
                        f"{backbone_class.__name__} does not take: re-export the model with this version of ltcx")
    check_setting_types(backbone_config, backbone_class, "config.json", "backbone_config.")


def _entry(architecture: Any, backbone_config: dict) -> catalog.Architecture:
    """The catalogue entry ``architecture`` names, consistent with ``backbone_config`` (Titans' ``variant``); one line
    for anything else (a class path, an unknown name)."""
    known = ", ".join(catalog.names())
    if not isinstance(architecture, str) or architecture not in catalog.CATALOG:
        raise LtcxError(f"config.json names architecture {str(architecture)[:100]!r}, which is not one of ltcx's "
                        f"(known: {known}): the folder is not an ltcx export, or needs a newer ltcx")
    entry = catalog.get(architecture)
    if catalog.architecture_name(entry.class_path, backbone_config) not in (None, architecture):
        raise LtcxError(f"config.json names architecture '{architecture}' but its backbone_config is that of "
                        f"'{catalog.architecture_name(entry.class_path, backbone_config)}': re-export the model")
    return entry


class LtcxCache(Cache):
    """A ``Cache`` holding one ltcx backbone state (whatever ``backbone(idx, state)`` returns) and the number of
    tokens it has consumed. ``reorder_cache`` (beam search) selects batch rows with the backbone's own
    ``reorder_cache``."""

    def __init__(self, state: Any = None, length: int = 0, reorder=None) -> None:
        super().__init__(layers=[])
        self.state, self.length, self._reorder = state, length, reorder

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self._reorder(self.state, beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            batch = _batch_size(self.state)
            self.reorder_cache(torch.arange(batch).repeat_interleave(repeats))

    def reset(self) -> None:
        self.state, self.length = None, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise LtcxError("an ltcx backbone's state can not drop tokens (crop): it only moves forward")

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else _batch_size(self.state)

    def __repr__(self) -> str:
        return f"LtcxCache(length={self.length}, state={type(self.state).__name__})"


def _batch_size(state: Any) -> int:
    from ltcx.models.state import state_batch_size

    return state_batch_size(state)


class LtcxForCausalLM(PreTrainedModel, GenerationMixin):
    """A catalogue backbone as a causal LM: ``forward(input_ids, attention_mask=None, labels=None, cache=None,
    use_cache=None)`` returns ``CausalLMOutputWithPast`` (logits [B, T, V] as the backbone's, the mean next-token loss
    when ``labels`` [B, T] are given, -100 ignored); ``generate`` runs on the backbone's state through ``LtcxCache``,
    padded prompts through the backbone's padding mask."""

    config_class = LtcxConfig
    base_model_prefix = "backbone"
    main_input_name = "input_ids"
    _supports_cache_class = True
    _is_stateful = True  # no assisted generation: a state can not be rolled back

    def __init__(self, config: LtcxConfig) -> None:
        super().__init__(config)
        if config.architecture is None:
            raise LtcxError("this ltcx config names no architecture: load a folder written by ltcx export --format hf")
        backbone_class = resolve_backbone(_entry(config.architecture, config.backbone_config).class_path)
        self.backbone = backbone_class(**config.backbone_config)
        self._tied_weights_keys = _shared_parameters(self)
        config.tie_word_embeddings = bool(self._tied_weights_keys)
        self._computed_buffers = _non_persistent_buffers(self)
        if any(value.is_meta for value in self._computed_buffers.values()):
            # from_pretrained builds on the meta device; the file holds no non-persistent buffers (GTA's identity),
            # so their values come from a build on the CPU (its weights dropped).
            with torch.device("cpu"):
                self._computed_buffers = {f"backbone.{name}": value for name, value in
                                          _non_persistent_buffers(backbone_class(**config.backbone_config)).items()}
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The backbone initialised its weights when built, or they come from the file."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """transformers' ``from_pretrained``, checked: before anything is built, the folder's weights (their names
        and shapes) against the model its config describes, and that model's size against the memory here; after,
        every tensor the model needs loaded from the file (transformers would leave a missing one as uninitialised
        memory and call it "newly initialized") and finite. Then the non-persistent buffers (which the file does not
        hold and transformers leaves empty) put back as the backbone computed them."""
        source = f"Hugging Face folder '{pretrained_model_name_or_path}'"
        config = kwargs.get("config")
        if not isinstance(config, LtcxConfig):  # None, or where to read it
            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            config = LtcxConfig.from_pretrained(pretrained_model_name_or_path if config is None else config, **hub)
        stored = None if kwargs.get("state_dict") is not None else _stored_shapes(pretrained_model_name_or_path, kwargs)
        if stored is not None and config.architecture is not None:
            meta = {"backbone_class": _entry(config.architecture, config.backbone_config).class_path,
                    "backbone_config": config.backbone_config}
            check_backbone_fits(source, meta, stored, prefix="backbone.", each_tensor_once=True)
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        missing = sorted(set(info.get("missing_keys", ())) - set(model._computed_buffers))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise LtcxError(f"{source} lacks tensor {missing[0]}{more} of its model: the file is incomplete or "
                            "damaged; export it again (ltcx export --format hf)")
        with torch.no_grad():
            for name, value in model._computed_buffers.items():
                buffer = model.get_buffer(name)
                if buffer is not value:
                    buffer.copy_(value.to(buffer.dtype))
        check_finite(source, model.state_dict().items(), "export it again from a good checkpoint")
        return (model, info) if wants_info else model

    def get_input_embeddings(self) -> torch.nn.Module | None:
        for name in ("wte", "embedding"):
            if isinstance(getattr(self.backbone, name, None), torch.nn.Embedding):
                return getattr(self.backbone, name)
        return None

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: LtcxCache | None = None, labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                past_key_values: LtcxCache | None = None, inputs_embeds: torch.Tensor | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids [B, T] following ``cache``'s tokens -> logits [B, T, V] and the extended cache (``use_cache``).

        attention_mask [B, P + T] (or [B, T], the new tokens'): zeros where a row is padded (left, right or inside),
        passed to the backbone as its padding mask, so each real token's logits are those of its row's real tokens
        alone and the state skips the padding; a padded position's logits are meaningless."""
        if input_ids is None or inputs_embeds is not None:
            raise LtcxError("an ltcx model takes input_ids, not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, LtcxCache):
            if cache.get_seq_length() != 0:
                raise LtcxError(f"an ltcx model runs on its own state (LtcxCache), not a {type(cache).__name__}")
            cache = None  # an empty cache made for it (e.g. transformers' DynamicCache): start fresh
        mask = _new_tokens_mask(attention_mask, input_ids.shape, 0 if cache is None else cache.length)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        state = None if cache is None else cache.state
        logits, state = self.backbone(input_ids, state, mask=mask)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)
            scores = logits[:, :-1].flatten(0, 1)
            scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
            loss = F.cross_entropy(scores, shifted.flatten(), ignore_index=-100)
        new_cache = None
        if use_cache:
            length = (0 if cache is None else cache.length) + input_ids.shape[1]
            new_cache = cache if cache is not None else LtcxCache(reorder=self.backbone.reorder_cache)
            new_cache.state, new_cache.length = state, length
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=new_cache)

    def generate(self, *args: Any, **kwargs: Any):
        """transformers' ``generate``, the backbone's derived weights built once for all its steps."""
        with keeping_derived(self.backbone):
            return super().generate(*args, **kwargs)

    def _reorder_cache(self, cache: LtcxCache, beam_idx: torch.LongTensor) -> LtcxCache:
        cache.reorder_cache(beam_idx)
        return cache

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward makes its own LtcxCache

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, cache: LtcxCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """Only the tokens the state has not consumed yet, with the state."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if cache is not None and use_cache is not False:
            input_ids = input_ids[:, cache.get_seq_length():]
        else:
            cache = None
        return {"input_ids": input_ids.contiguous(), "cache": cache, "attention_mask": attention_mask,
                "use_cache": use_cache}


def _new_tokens_mask(attention_mask: torch.Tensor | None, shape: torch.Size, past: int) -> torch.Tensor | None:
    """The backbone's mask [B, T] (True = real) of the new tokens from transformers' ``attention_mask`` [B, P + T] or
    [B, T]; None where every new token is real (the cache keeps what earlier masks said)."""
    if attention_mask is None:
        return None
    batch, length = shape
    if attention_mask.ndim != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in (
            length, past + length):
        raise LtcxError(f"attention_mask of shape {list(attention_mask.shape)} does not fit input_ids "
                        f"{[batch, length]} after {past} cached tokens: pass [batch, cached + new tokens] (ones, zeros "
                        "at padding)")
    mask = attention_mask[:, attention_mask.shape[1] - length:].to(device=attention_mask.device, dtype=torch.bool)
    return None if bool(mask.all()) else mask


# from_pretrained's arguments that say where a folder's files are (the hub's, a subfolder).
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
_WEIGHTS, _WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def _stored_shapes(name_or_path: Any, kwargs: dict) -> dict[str, list[int]] | None:
    """Each weight's name and shape in the folder ``name_or_path`` (or a hub repository, through transformers'
    cache), read from the safetensors headers without reading a tensor: ``model.safetensors`` or the shards its
    index names. None where there is no such file to read (transformers then says what is missing)."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}

    def find(filename: str) -> Path | None:
        try:
            found = cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False, **hub)
        except Exception:  # noqa: BLE001 - not reachable or not a folder: from_pretrained says why
            return None
        return Path(found) if found else None

    single = find(_WEIGHTS)
    if single is not None:
        files = [single]
    else:
        index = find(_WEIGHTS_INDEX)
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index else []
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # a damaged index: transformers' own reading names it
        files = [find(shard) for shard in shards]
        if not files or None in files:
            return None
    shapes: dict[str, list[int]] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    except Exception:  # noqa: BLE001 - a damaged file: transformers' own reading names it
        return None
    return shapes


def _non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}" if prefix else name: module.get_buffer(name)
            for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set}


def _shared_parameters(model: torch.nn.Module) -> dict[str, str]:
    """``{target: source}`` for parameters registered under several names (tied embeddings), so that
    ``save_pretrained`` stores them once and loading ties them again."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def hf_model(backbone: torch.nn.Module, tokenizer_vocab_size: int | None = None) -> LtcxForCausalLM:
    """``LtcxForCausalLM`` holding a copy of ``backbone``'s weights (float32 as it is; eval mode)."""
    name = catalog.architecture_name(class_path(type(backbone)), backbone.config_dict())
    if name is None:
        raise LtcxError(f"backbone class '{class_path(type(backbone))}' is not a catalogue architecture: only those "
                        "export to transformers")
    vocab = backbone.config_dict().get("vocab_size")
    context = {} if backbone.max_seq_len is None else {"max_position_embeddings": backbone.max_seq_len}  # lm_eval's
    config = LtcxConfig(architecture=name, backbone_config=backbone.config_dict(),
                        tokenizer_vocab_size=tokenizer_vocab_size if tokenizer_vocab_size != vocab else None, **context)
    model = LtcxForCausalLM(config)
    model.backbone.load_state_dict(backbone.state_dict())
    return model.eval()


AutoConfig.register(MODEL_TYPE, LtcxConfig, exist_ok=True)
AutoModelForCausalLM.register(LtcxConfig, LtcxForCausalLM, exist_ok=True)
