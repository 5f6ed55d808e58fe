"""A Hugging Face transformers architecture, its attention the engine's: the `hf` extra.

The model is transformers' own `LlamaForCausalLM` or `Qwen3ForCausalLM`
(with sliding-window layers where `ModelConfig.layer_kinds` says "window",
run through the engine's window pages), built from a small config with
weights drawn from `ModelConfig.seed` (no download). Its embedding, norms,
rotary embedding, attention module (projections, Qwen3's per-head q/k
norms, `apply_rotary_pos_emb`, the output projection), MLPs and `lm_head`
run as transformers wrote them; only the attention core is the engine's:
an attention function registered with transformers' `AttentionInterface`
hands each layer's rotated queries, keys and values to the engine's
`Attend` (the paged or ragged kernel over the engine's KV cache, or a
request's own contiguous cache). The decoder layer's residual order is
restated here (two lines) so that a data-parallel rank can run its share
of the MLP between the norm and the residual add.

The oracle is a second copy of the same weights with transformers' default
attention (`sdpa`), run by `transformers.generate` (`HfModel.generate`).

This is the one module that touches transformers, which is partly typed:
its objects are held as `Any` here and nowhere else.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Final, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate import Sampling, SamplingParams
from batchstate.engine._model import Attend, FeedForward
from batchstate.engine._model_config import ModelConfig
from batchstate.engine._sampler import sample_logits

__all__ = ["HfModel", "make_hf_model"]

_ATTENTION: Final = "batchstate"  # the name the engine's attention is registered under
_ATTEND_KWARG: Final = "batchstate_attend"  # how a forward hands its `Attend` to it
# Weights drawn wider than transformers' default (normal, std 0.02): at 0.02 the logits
# of a small random model are nearly flat and greedy decoding repeats one token; at 0.5
# outputs vary (measured: 14-26 distinct tokens in 30, over 20 prompts).
_INIT_STD: Final = 0.5


def _engine_attention(  # noqa: PLR0917  # transformers' attention-function signature
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # transformers' attention-function contract: query `[1, heads, tokens, d]`, key and
    # value `[1, kv heads, tokens, d]` (rotated, not repeated for grouped queries); it
    # returns `[1, tokens, heads, d]`. The engine's kernels take `[tokens, heads, d]` and
    # scale by 1/sqrt(head_dim), which is what both architectures use.
    del attention_mask, dropout  # the engine's kernels mask from the forward's inputs
    if abs(scaling * query.shape[-1] ** 0.5 - 1.0) > 1e-6:
        raise ValueError(f"attention scaled by {scaling}, not 1/sqrt(head_dim)")
    attend: Attend = kwargs[_ATTEND_KWARG]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return attend(module.layer_idx, q, k, v)[None], None


def _register() -> None:
    from transformers import AttentionInterface  # noqa: PLC0415  (the optional extra)

    AttentionInterface.register(_ATTENTION, _engine_attention)


@final
class HfModel:
    """A transformers causal LM run through the engine's attention (see the module's notes).

    NOTE: holds torch modules (mutable); nothing here writes them after `make_hf_model`.
    """

    def __init__(self, config: ModelConfig, lm: Any, oracle: Any, num_layers: int) -> None:
        self._config = config
        self._lm = lm  # the engine's copy: attention registered as _ATTENTION
        self._oracle = oracle  # the same weights with transformers' default attention
        self._layers = lm.model.layers[:num_layers]
        self._device = torch.device(lm.device)

    @property
    def config(self) -> ModelConfig:
        """Its sizes and architecture (`num_layers` counts the layers it runs)."""
        return self._config

    @property
    def device(self) -> torch.device:
        """Where its weights live."""
        return self._device

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        feed_forward: FeedForward | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, d_model]`; positions feed the rotary embedding."""
        mlp = self.mlp if feed_forward is None else feed_forward
        backbone = self._lm.model
        if not input_ids.shape[0]:  # no tokens (an idle rank): the MLPs still join their ranks
            x = torch.zeros(0, self._config.d_model, dtype=self._config.torch_dtype)
            x = x.to(self._device)
            for index in range(len(self._layers)):
                mlp(index, x)
            return x
        x = backbone.embed_tokens(input_ids[None])
        rotary = backbone.rotary_emb(x, positions[None])
        for index, layer in enumerate(self._layers):
            attended, _ = layer.self_attn(
                hidden_states=layer.input_layernorm(x),
                position_embeddings=rotary,
                attention_mask=None,
                **{_ATTEND_KWARG: attend},
            )
            x = x + attended
            x = x + mlp(index, layer.post_attention_layernorm(x)[0])[None]
        out: torch.Tensor = backbone.norm(x)[0]
        return out

    def mlp(self, layer: int, x: torch.Tensor, hidden_units: slice = slice(None)) -> torch.Tensor:
        """Layer `layer`'s gated MLP, `down(act(gate(x)) * up(x))`, through `hidden_units` only.

        The whole width runs transformers' module; a slice runs the same
        weights' rows (gate, up) and columns (down), so that disjoint slices
        add up to the whole (how data-parallel ranks share it).
        """
        module = self._layers[layer].mlp
        if hidden_units == slice(None):
            whole: torch.Tensor = module(x)
            return whole
        linear = torch.nn.functional.linear
        gate = linear(x, module.gate_proj.weight[hidden_units])
        up = linear(x, module.up_proj.weight[hidden_units])
        out: torch.Tensor = linear(
            module.act_fn(gate) * up, module.down_proj.weight[:, hidden_units]
        )
        return out

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each hidden state (torch's argmax: a tie goes to the lowest id,
        as in `generate`'s greedy search)."""
        return self.logits(hidden).argmax(dim=-1)

    def sample(
        self, hidden: torch.Tensor, sampling: Sampling | None, positions: npt.NDArray[np.int64]
    ) -> torch.Tensor:
        """Each hidden state's next token under its row's sampling parameters (see
        `engine/_sampler.py`); greedy rows get exactly `greedy`'s token."""
        if sampling is None:
            return self.greedy(hidden)
        return sample_logits(self.logits(hidden), sampling, positions)

    def first_layers(self, num_layers: int) -> HfModel:
        """The same model running its first `num_layers` decoder layers (a draft model)."""
        config = attrs.evolve(self._config, num_layers=num_layers)
        return HfModel(config, self._lm, self._oracle, num_layers)

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, end_token: int, sampling: SamplingParams
    ) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """`transformers.generate` on the oracle copy: the tokens, and each step's raw logits.

        Greedy requests decode with `do_sample=False` (argmax). A sampled request
        draws as the engine does, from its `(seed, position)` stream: a logits
        processor keeps only the engine sampler's token for generate's argmax to
        pick (generate's own sampling draws from torch's global RNG, which no
        batch order can reproduce).
        """
        if self._config.num_layers != len(self._oracle.model.layers):
            raise ValueError("generate runs the whole model, not a draft cut from it")
        device = self._device
        ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)
        processors = [] if sampling.temperature == 0 else [_EngineDraw(sampling, device)]
        out = self._oracle.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=end_token,
            pad_token_id=end_token,
            logits_processor=processors,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = tuple(int(token) for token in out.sequences[0, len(prompt) :].tolist())
        return tokens, [step[0] for step in out.logits]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head` over hidden states: `[rows, vocab_size]`."""
        logits: torch.Tensor = self._lm.lm_head(hidden)
        return logits


def _layer_types(config: ModelConfig) -> dict[str, Any]:
    # Qwen3's sliding-window layers: transformers masks each query to keys q - window + 1 to
    # q (masking_utils' sliding window), the engine's window layer to its last `window`
    # positions, itself included: the same keys.
    if not config.count("window"):
        return {}
    kinds = {"window": "sliding_attention", "full": "full_attention"}
    return {
        "use_sliding_window": True,
        "sliding_window": config.window,
        "layer_types": [kinds[config.kind(layer)] for layer in range(config.num_layers)],
    }


@final
class _EngineDraw:
    # A transformers logits processor: every token but the engine sampler's gets -inf.
    def __init__(self, sampling: SamplingParams, device: torch.device) -> None:
        self._columns = Sampling.of([sampling], device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = np.array([input_ids.shape[1]], dtype=np.int64)  # the drawn token's
        token = sample_logits(scores, self._columns, position)
        kept = torch.full_like(scores, -torch.inf)
        kept[0, token[0]] = 0.0
        return kept


def make_hf_model(config: ModelConfig, device: torch.device | str = "cpu") -> HfModel:
    """`config.architecture`'s transformers model, weights drawn from `config.seed`.

    Raises:
        ImportError: transformers is not installed (the `hf` extra).
        ValueError: `config` is the tiny model's, or its heads do not split.
    """
    import transformers  # noqa: PLC0415  (the optional extra)

    if config.architecture == "tiny":
        raise ValueError("the tiny model is make_model's, not a transformers architecture")
    if config.d_model % config.num_heads or config.num_heads % config.kv_groups:
        raise ValueError(f"{config}: heads must split d_model, and K/V groups the heads")
    if config.count("state"):
        raise ValueError("a transformers model here has full and sliding-window layers only")
    if config.count("window") and config.architecture != "qwen3":
        raise ValueError("sliding-window layers are Qwen3's (its layer_types)")
    _register()
    classes: dict[str, tuple[Any, Any]] = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[config.architecture]
    hf_config = config_class(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=4096,
        initializer_range=_INIT_STD,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        **_layer_types(config),
    )
    # Drawn on the CPU from the config's seed, leaving torch's global RNG as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        oracle: Any = model_class(hf_config)
    oracle = oracle.to(device=device, dtype=config.torch_dtype).eval().requires_grad_(False)
    lm = copy.deepcopy(oracle)
    lm.set_attn_implementation(_ATTENTION)
    return HfModel(config, lm, oracle, config.num_layers)
