"""A tiny Qwen3 mixture-of-experts policy with the character tokenizer, for MoE experiments on a CPU."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_lightning.models.char_tokenizer import DEFAULT_ALPHABET
from gspo_lightning.models.loaders import TinyQwen3


class TinyQwen3Moe(TinyQwen3):
    """``TinyQwen3`` whose MLPs are sparse mixtures of experts (``Qwen3MoeForCausalLM``), randomly initialised.

    Usable wherever ``TinyQwen3`` is, e.g. as the ``base`` of ``WarmStartedTinyQwen3``.
    """

    def __init__(
        self,
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 128,
        norm_topk_prob: bool = True,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 512,
        max_position_embeddings: int = 64,
        alphabet: str = DEFAULT_ALPHABET,
        seed: int = 0,
    ) -> None:
        """
        Args:
            num_experts: experts per MoE layer.
            num_experts_per_tok: experts each token is routed to (top-k).
            moe_intermediate_size: width of each expert's MLP.
            norm_topk_prob: renormalise the top-k routing weights to sum to 1 (Qwen3-MoE does).
            hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings,
                alphabet, seed: as in ``TinyQwen3``; every layer is an MoE layer (``intermediate_size`` is unused).
        """
        super().__init__(
            hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings, alphabet, seed
        )
        if num_experts < 2:
            raise ValueError(f"num_experts must be >= 2, got {num_experts}")
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {num_experts_per_tok}")
        if moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {moe_intermediate_size}")
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob

    def settings(self) -> dict[str, Any]:
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
        return super().settings() | {"kind": "moe"} | {name: getattr(self, name) for name in moe}

    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        """A freshly initialised float32 ``Qwen3MoeForCausalLM`` sized for ``tokenizer``'s vocabulary."""
        config = Qwen3MoeConfig(
            **self.config_settings(tokenizer),
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=1,  # every layer is an MoE layer
        )
        return self.initialise(Qwen3MoeForCausalLM, config)
