"""NSAConfig / NSAForCausalLM: the library's TinyLM behind transformers' PreTrainedModel and generate().

The HF model holds one `nsa.TinyLM` as `self.model` (state_dict keys are the TinyLM's, prefixed `model.`),
so its forward is the TinyLM's forward and the logits are the same numbers. Cached generation keeps the
library's own decode caches (NSAKVCache per NSA layer, DenseKVCache for the dense twin) in an `NSACache`
that travels through generate() as the model's cache: prefill fills them (TinyLM.prefill), every later
step runs TinyLM.decode_step, so HF greedy decoding equals TinyLM.generate(..., cuda_graph=False).

Not supported (each raises a one-line error): padded batches (an attention_mask with zeros: the NSA
caches take no mask), inputs_embeds, and searches that reorder the cache (beam search).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nsa.model.tinylm import TinyLM

MODEL_TYPE = "nsa_tinylm"

# TinyLM constructor arguments the config records (HF name -> TinyLM name). Training-only switches
# (grad_checkpointing, compile_blocks) are not part of an exported model.
_RENAMED = {"vocab_size": "vocab", "tie_word_embeddings": "tie_embeddings"}
_TRAINING_ONLY = ("grad_checkpointing", "compile_blocks")
_DEFAULTS = {n: p.default for n, p in inspect.signature(TinyLM.__init__).parameters.items()
             if n != "self" and n not in _TRAINING_ONLY}
_FIELDS = tuple(n for n in _DEFAULTS if n not in _RENAMED.values())   # stored under the TinyLM name

# transformers 5.x names the generate cache `cache` (outputs and kwargs); 4.x named it `past_key_values`
_OUTPUT_CACHE_FIELD = ("cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
                       else "past_key_values")


class NSAConfig(PretrainedConfig):
    """Shape and attention settings of a TinyLM (the constructor arguments, under the same names), plus
    transformers' vocab_size / tie_word_embeddings. `hidden_size`, `num_hidden_layers`,
    `num_attention_heads` and `num_key_value_heads` read dim, n_layers, n_heads and n_kv_groups.
    Not to be confused with nsa.config.NSAConfig (the training config's `nsa` section)."""

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers",
                     "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_groups"}

    def __init__(self, vocab_size: int = _DEFAULTS["vocab"],
                 tie_word_embeddings: bool = _DEFAULTS["tie_embeddings"],
                 eos_token_id: int | None = 0, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        for name in _FIELDS:
            setattr(self, name, kwargs.pop(name, _DEFAULTS[name]))
        super().__init__(tie_word_embeddings=tie_word_embeddings, eos_token_id=eos_token_id, **kwargs)

    def tinylm_kwargs(self) -> dict[str, Any]:
        """The TinyLM constructor arguments this config describes."""
        kw = {name: getattr(self, name) for name in _FIELDS}
        kw.update(vocab=self.vocab_size, tie_embeddings=bool(self.tie_word_embeddings))
        return kw

    @classmethod
    def from_tinylm_kwargs(cls, kwargs: dict[str, Any], **extra: Any) -> "NSAConfig":
        """From TinyLM constructor arguments (e.g. TinyLM.config_kwargs of a checkpoint's config)."""
        kw = {k: v for k, v in kwargs.items() if k not in _TRAINING_ONLY}
        unknown = sorted(set(kw) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"NSAConfig: unknown TinyLM arguments {unknown}")
        for hf_name, name in _RENAMED.items():
            if name in kw:
                kw[hf_name] = kw.pop(name)
        return cls(**kw, **extra)


class NSACache:
    """The generate() cache of an NSAForCausalLM: one library decode cache per layer (`layers`, filled by
    the first forward). Duck-types the parts of transformers' Cache that generate() reads."""

    is_compileable = False    # no static shapes: transformers must not build 4D masks or compile for it
    is_croppable = False      # assisted decoding would need to roll tokens back

    def __init__(self) -> None:
        self.layers: list[Any] = []

    @property
    def is_linear(self) -> list[bool]:   # transformers: "not a linear-attention state" -> it slices inputs
        return [False] * max(1, len(self.layers))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.layers[layer_idx].length) if self.layers else 0

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        kind = type(self.layers[0]).__name__ if self.layers else "empty"
        return f"NSACache({len(self.layers)} layers of {kind}, {self.get_seq_length()} tokens)"


class NSAForCausalLM(PreTrainedModel, GenerationMixin):
    """A TinyLM (NSA or dense twin) as a transformers causal LM; see the module doc."""

    config_class = NSAConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["LlamaBlockNSA"]
    # used by transformers only when config.tie_word_embeddings (TinyLM ties them itself as well)
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: NSAConfig) -> None:
        super().__init__(config)
        self.model = TinyLM(**config.tinylm_kwargs())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # TinyLM's own initialisation (GPT-2 style) for a fresh model; loaded weights overwrite it
        if isinstance(module, TinyLM):
            module.reset_parameters()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # generate() must not make a DynamicCache: forward makes its NSACache

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: NSACache | None = None, past_key_values: NSACache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                logits_to_keep: int = 0, inputs_embeds: torch.Tensor | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> CausalLMOutputWithPast | tuple:
        """input_ids [B, T] -> logits [B, T, vocab] (the last `logits_to_keep` positions when > 0).

        Without a cache and without use_cache=True this is TinyLM.forward. With use_cache=True (as
        generate() passes) or a cache, the first call prefills a new NSACache and later calls decode
        the new tokens after the cached ones; the returned output carries the cache. position_ids are
        not needed (positions follow the cache) and are ignored, as are output_attentions and the like."""
        if inputs_embeds is not None:
            raise ValueError("NSAForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("NSAForCausalLM: input_ids are required")
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError("NSAForCausalLM: padded batches are not supported (the NSA decode caches take no "
                             "attention mask); pass prompts of equal length without padding")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, NSACache):
            if cache.get_seq_length() != 0:
                raise ValueError(f"NSAForCausalLM: cannot continue from a {type(cache).__name__}; pass the "
                                 "NSACache a previous call returned")
            cache = None            # an empty foreign cache (a DynamicCache someone made): use ours
        if cache is None and use_cache:
            cache = NSACache()
        tinylm = self.model
        keep = int(logits_to_keep or 0)
        if cache is None:
            logits = tinylm(input_ids)
        elif not cache.layers:
            logits, cache.layers = tinylm.prefill(input_ids, last_only=keep == 1)
        else:
            logits = tinylm.decode_step(input_ids, cache.layers)
        if keep > 0:
            logits = logits[:, -keep:]
        loss = None
        if labels is not None:
            # next-token loss as training computes it: position t predicts token t + 1 (-100 ignored)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_OUTPUT_CACHE_FIELD: cache})
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, cache: NSACache | None = None,
                                      past_key_values: NSACache | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                                      logits_to_keep: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """Feed only the tokens the cache has not seen (all of them on the first step)."""
        if inputs_embeds is not None:
            raise ValueError("NSAForCausalLM.generate takes input_ids, not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        seen = cache.get_seq_length() if cache is not None else 0
        inputs = {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask, "use_cache": use_cache,
                  _OUTPUT_CACHE_FIELD: cache}
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs

    def _reorder_cache(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("NSAForCausalLM: beam search is not supported (the NSA caches are not "
                                  "reordered); use greedy decoding or sampling")
