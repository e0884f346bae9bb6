"""A tiny model directory that real vLLM can serve on CPU with no download (tests, demos).

``config.json`` describes a Llama of 2 layers by default (hidden 256, 4 heads of 64, 2 KV heads,
vocab 1024);
vLLM fills it with random weights (``load_format="dummy"``), so its output is noise but every
engine mechanism — batching, prefix caching, KV events, preemption — is real. With
``tokenizer=True`` a small byte-level BPE tokenizer is saved beside it, for text prompts and
chat: trained here with the ``tokenizers`` package that vLLM brings, on text this package ships
(its own module docstrings, plus the test vocabulary :data:`WORDS`; nothing is downloaded), BOS
prepended like Llama's, with a chat template, so ``vllm serve`` answers ``/v1/chat/completions``
and text ``/v1/completions`` like a real model server (with noise for output).
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

VOCAB = 1024
#: the dtype to serve the tiny model in (``--dtype``). vLLM's "auto" turns a float32 model into
#: bfloat16 on CPU, and on a CPU with AMX its attention then takes the AMX kernel, which never asks
#: Linux for the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``): oneDNN asks only when a
#: matmul takes its AMX path, which a model this small never does, so the first step dies with
#: SIGILL. float32 takes the AVX-512/AVX2 kernel on every x86 CPU.
DTYPE = "float32"
#: the depth for a test that must act *during* a run (cancel it, drain or kill its worker): ~16 ms a
#: step in :data:`DTYPE`, which vLLM's output handler keeps up with (see :func:`write_tiny_model`).
#: Measured beside two CPU hogs, a cancel after 2 of 900 tokens: with 2 layers every run made all
#: 900; with 12 (bfloat16) 3 runs of 4 did; with 16 all 4 stopped by token 83.
LIVE_LAYERS = 16
WORDS = ("the quick brown fox jumps over lazy dog system prompt knowledge base user question answer "
         "routing cache prefix token worker model engine request reply tenant quota batch online").split()

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,  # head_dim 64: the CPU attention backend needs >= 64
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32768,  # room for long generations; each test sets its own max_model_len
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def write_tiny_model(directory: str | Path, tokenizer: bool = False,
                     layers: int = CONFIG["num_hidden_layers"]) -> Path:
    """Write ``config.json`` (and a tokenizer when asked) into ``directory``; returns it.

    ``layers`` sets the model's depth, i.e. how long an engine step takes. With 2 layers a step
    takes ~2.3 ms on CPU, less than vLLM's output handler needs per step: its queue then never
    empties, its awaits complete without yielding, and the streams, ``/metrics``, heartbeats and
    disconnect checks of the process it runs in wait until the run is over. A test that must act
    during a run asks for :data:`LIVE_LAYERS`."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}, indent=1))
    if tokenizer:
        _write_tokenizer(path)
    return path


#: a plain template in the Llama-2 style (BOS, role-tagged turns); vLLM and HF render it with Jinja
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def shipped_text() -> list[str]:
    """The docstrings of natsched's own modules, classes and functions: English about this domain,
    in every install (sorted by path, so the tokenizer is the same wherever it is trained)."""
    root = Path(__file__).resolve().parents[1]
    out: list[str] = []
    for py in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(py.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.append(doc)
    return out


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = shipped_text() + [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(400)]
    roles = ["<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 24, special_tokens=["<unk>", "<s>", "</s>", *roles],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))


#: the projections a tiny LoRA adapter adapts: every attention projection of each layer (PEFT's names;
#: vLLM maps q/k/v onto its packed ``qkv_proj``)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_tiny_lora(directory: str | Path, rank: int = 8, seed: int = 0, scale: float = 0.05,
                    layers: int = CONFIG["num_hidden_layers"]) -> Path:
    """A LoRA adapter for the tiny model, in PEFT's on-disk format, with small random weights.

    ``adapter_config.json`` (rank, alpha, the target modules) and ``adapter_model.safetensors``
    (``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` per layer and projection, under
    PEFT's ``base_model.model.`` prefix) are what ``vllm serve --lora-modules NAME=PATH`` loads;
    written here with torch and safetensors, nothing downloaded. ``lora_B`` is not zero (PEFT's
    init), so the adapter does change the model's output: a request that runs with it answers
    differently from the base model. ``layers`` matches the depth given to :func:`write_tiny_model`.
    """
    import torch
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    hidden = CONFIG["hidden_size"]
    head_dim = hidden // CONFIG["num_attention_heads"]
    kv = CONFIG["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(LORA_TARGETS), "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": None, "fan_in_fan_out": False, "modules_to_save": None,
    }, indent=1))
    return path
