"""The warm-start cache: one folder per configuration, ``<root>/warm_start/<hash of its settings>``, holding the
model (safetensors), its config and tokenizer, and the training report; written atomically, so a reader never
sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

REPORT_FILE = "warm_start.json"
MODEL_FILE = "model.safetensors"
CACHE_ENV_VAR = "GSPO_LIGHTNING_CACHE"


def cache_root(cache_dir: str | None = None) -> Path:
    """Root of gspo_lightning's caches: ``cache_dir``, else ``$GSPO_LIGHTNING_CACHE``, else ``~/.cache``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    return Path.home() / ".cache" / "gspo_lightning"


def settings_hash(settings: dict[str, Any]) -> str:
    """A short, stable hash of JSON-serialisable settings."""
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def is_complete(path: Path) -> bool:
    """The report, the model's config and its weights are all in ``path``."""
    return all((path / name).is_file() for name in (REPORT_FILE, "config.json", MODEL_FILE))


def save_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, report: dict[str, Any], path: Path
) -> None:
    """Write model, tokenizer and report to a temp directory, then rename it into place.

    A reader never sees a half-written cache, even if this process is killed while saving. The tokenizer is
    saved too, so the directory also loads with ``Pretrained(name_or_path=...)``. The model is written with
    safetensors, not ``save_pretrained``: once torch.distributed is initialised, transformers writes a model
    only on global rank 0, and whichever rank holds the lock trains the warm start.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(one_name_per_tensor(model), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def one_name_per_tensor(model: PreTrainedModel) -> dict[str, Tensor]:
    """The state dict with one name per shared tensor, the first in the model's order (the input embedding of
    tied weights, as ``save_pretrained`` keeps it: loading then initialises nothing, which would draw random
    numbers, and ties the head to it)."""
    tensors: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach().contiguous()
    return tensors
