"""LoRA through ``peft``: a ``PolicyLoader`` decorator that trains (and exports) a low-rank adapter only.

``LoRA`` wraps any other loader (``Pretrained``, ``TinyQwen3``, ...). The base model's weights are frozen, so
only the adapter is in the optimizer, and ``ExportPolicy`` writes the adapter alone (``adapter_config.json`` +
adapter weights, loaded with ``peft.PeftModel.from_pretrained(base, dir)``) or, with ``merge_on_export``, a
plain model with the adapter merged in. Needs the ``peft`` extra: ``pip install 'gspo-lightning[peft]'``.
"""

from __future__ import annotations

import copy
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_lightning.models.loaders import PolicyLoader
from gspo_lightning.validation import require

if TYPE_CHECKING:
    from peft import PeftModel

INSTALL_HINT = "pip install 'gspo-lightning[peft]'"


def _import_peft() -> ModuleType:
    """The ``peft`` package, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as error:
        raise ImportError(f"LoRA needs the optional dependency peft: {INSTALL_HINT}") from error
    return peft


def _valid_target_modules(target_modules: object) -> bool:
    if isinstance(target_modules, str):
        return bool(target_modules.strip())
    return (
        isinstance(target_modules, (list, tuple))
        and len(target_modules) > 0
        and all(isinstance(name, str) and name.strip() for name in target_modules)
    )


class LoRA(PolicyLoader):
    """A LoRA adapter (``peft``) on the model of another loader: only the adapter trains and is exported."""

    def __init__(
        self,
        base: PolicyLoader,
        r: int = 16,
        alpha: int = 32,
        dropout: float = 0.0,
        target_modules: list[str] | str = "all-linear",
        merge_on_export: bool = False,
    ) -> None:
        """Configure the adapter.

        Args:
            base: the loader of the model to adapt (``Pretrained``, ``TinyQwen3``, ``WarmStartedTinyQwen3`` or
                your own ``PolicyLoader``); its tokenizer is used unchanged and its weights stay frozen.
            r: rank of the low-rank update (an integer >= 1).
            alpha: LoRA scaling numerator; the update is scaled by ``alpha / r``.
            dropout: dropout on the adapter's input, in [0, 1). Only active in train mode, and
                ``GSPOModule`` keeps the policy in eval mode (so pi_old and pi_theta agree), so it has no
                effect there; it is stored in the adapter config for other trainers.
            target_modules: ``all-linear`` (every linear layer but the output head), a regex matched
                against full module names, or a list of module name suffixes (e.g. ``[q_proj, v_proj]``).
            merge_on_export: export a plain model with the adapter merged into the base weights
                (``from_pretrained`` loads it without peft) instead of the adapter alone.
        """
        _import_peft()  # fail when the config is parsed, not after the data and trainer are built
        require(
            isinstance(base, PolicyLoader) and not isinstance(base, LoRA),
            f"LoRA.base must be a PolicyLoader other than LoRA (e.g. Pretrained, TinyQwen3), got {base!r}",
        )
        require(
            isinstance(r, int) and not isinstance(r, bool) and r >= 1,
            f"LoRA.r must be an integer >= 1, got {r!r}",
        )
        require(
            isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0,
            f"LoRA.alpha must be a number > 0, got {alpha!r}",
        )
        require(0.0 <= dropout < 1.0, f"LoRA.dropout must be in [0, 1), got {dropout!r}")
        require(
            _valid_target_modules(target_modules),
            "LoRA.target_modules must be 'all-linear', a module-name regex or a non-empty list of module "
            f"names, got {target_modules!r}",
        )
        if dropout > 0:
            warnings.warn(
                f"LoRA.dropout={dropout} has no effect under GSPOModule, which keeps the policy in eval mode",
                stacklevel=2,
            )
        self.base = base
        self.r = r
        self.alpha = alpha
        self.dropout = dropout
        # peft wants a list (or a str); YAML may give a tuple-like sequence
        self.target_modules = target_modules if isinstance(target_modules, str) else list(target_modules)
        self.merge_on_export = merge_on_export

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The base loader's tokenizer: an adapter does not change the vocabulary."""
        return self.base.load_tokenizer()

    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PeftModel:
        """The base loader's model wrapped in a fresh adapter; only the adapter's weights require grad.

        The adapter starts as the identity (peft initialises ``lora_B`` to zeros), so the wrapped model
        computes exactly what the base model does until the first update.
        """
        peft = _import_peft()
        model = self.base.load_model(tokenizer)
        config = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
        )
        # get_peft_model freezes every base weight (requires_grad False), so the optimizer skips them
        return peft.get_peft_model(model, config)

    def model_for_export(self, model: PeftModel) -> PeftModel | PreTrainedModel:
        """The adapter (the ``PeftModel`` itself: ``save_pretrained`` writes only ``adapter_config.json`` and
        the adapter weights) or, with ``merge_on_export``, a plain model with the adapter merged in.

        The merge runs on a deep copy (briefly twice the policy's memory): ``merge_and_unload`` folds the
        adapter into the base weights in place and removes it, and the training model must keep both apart.
        """
        peft = _import_peft()
        if not isinstance(model, peft.PeftModel):
            raise TypeError(
                f"LoRA.model_for_export expects the PeftModel that LoRA.load_model built, got {type(model).__name__}"
            )
        if not self.merge_on_export:
            return model
        # safe_merge: refuse to export if merging produced non-finite weights
        return copy.deepcopy(model).merge_and_unload(safe_merge=True)
